"""Checkpoint loads read only what a rank needs: on the layout that saved the checkpoint every
rank reads its own file (plus the global index's header and its sections), so the ranks
together read about the checkpoint once and each opens a handful of files; on another layout
only the saved pieces that overlap the rank's new shard. Measured from the `checkpoint_load`
records (bytes read, files opened: the tracker, the index and the data files)."""
import os

from dist_helpers import run_pretrain
from tiny import mock, tiny

BASE = mock(1000) + tiny(num_layers=4, train_iters=None, log_interval=1, eval_iters=0, use_distributed_optimizer=True,
                          ddp_bucket_size=5000, lr_decay_iters=10)  # (the resumes run longer: the same schedule)
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def loads(records):
    out = {r["rank"]: r for r in records if r.get("event") == "checkpoint_load"}
    return [out[k] for k in sorted(out)]


def test_loads_read_their_share(tmp_path):
    ck = str(tmp_path / "ck")
    run_pretrain(8, BASE + TP2PP2 + ["--train-iters", "2", "--save", ck], tmp_path, "save")
    directory = os.path.join(ck, "iter_0000002")
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))

    same, _ = run_pretrain(8, BASE + TP2PP2 + ["--train-iters", "3", "--load", ck], tmp_path, "same")
    same_loads = loads(same)
    assert len(same_loads) == 8 and [r["iteration"] for r in same if "consumed_samples" in r] == [3]
    assert sum(r["bytes_read"] for r in same_loads) <= 1.2 * size, (same_loads, size)
    assert max(r["files_opened"] for r in same_loads) <= 4, same_loads

    dp4, _ = run_pretrain(4, BASE + ["--train-iters", "3", "--load", ck], tmp_path, "dp4")
    dp4_loads = loads(dp4)
    assert len(dp4_loads) == 4 and [r["iteration"] for r in dp4 if "consumed_samples" in r] == [3]
    assert sum(r["bytes_read"] for r in dp4_loads) <= 2.0 * size, (dp4_loads, size)
