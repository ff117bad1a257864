"""Weights & Biases (offline) and TensorBoard logging: one rank logs the console line's metrics,
the config and the evaluations, and (--log-timers-to-tensorboard) the per-phase timers; neither
package is required unless asked for."""
import glob
import json
import math
import os
import re
import struct
import sys

import pytest

from dist_helpers import run_pretrain

from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.config.run import json_safe
from megalite.runtime.timers import INTERVAL_TIMERS
from megalite.runtime.tracking import Tracker
from tiny import mock, tiny

BASE = mock(1000) + tiny(global_batch_size=4, train_iters=4, log_interval=2, eval_interval=2, eval_iters=1)


# -- without the packages ----------------------------------------------------------------------------
@pytest.mark.parametrize("flags,package", [(["--wandb-project", "p"], "wandb"),
                                           (["--tensorboard-dir", "tb"], "tensorboard")])
def test_missing_package_fails_at_start_up(monkeypatch, flags, package):
    monkeypatch.setitem(sys.modules, package, None)  # import and find_spec now fail as if not installed
    with pytest.raises(ArgumentError, match=f"{flags[0]} needs the {package} package.*pip install {package}"):
        validate_args(parse_args(BASE + flags), world_size=1)
    validate_args(parse_args(BASE), world_size=1)  # not asked for: not needed


def test_wandb_options_need_a_project():
    with pytest.raises(ArgumentError, match="--wandb-exp-name needs --wandb-project"):
        validate_args(parse_args(BASE + ["--wandb-exp-name", "x"]), world_size=1)


def test_json_safe_config():
    import torch
    safe = json_safe({"dtype": torch.bfloat16, "paths": ("a", "b"), "nan": float("nan"), "n": None, "x": 1.5,
                      "obj": object})
    assert json.loads(json.dumps(safe)) == safe
    assert safe["dtype"] == "bfloat16" and safe["paths"] == ["a", "b"] and safe["nan"] == "nan"


def test_disabled_tracker_writes_nothing(tmp_path):
    config = validate_args(parse_args(BASE + ["--tensorboard-dir", str(tmp_path / "tb")]), world_size=1)
    t = Tracker(config.tracking, enabled=False)  # not the logging rank
    t.log_config(config.to_dict())
    t.log({"lm_loss": 1.0}, 1, "train")
    t.close()
    assert not t.active and not (tmp_path / "tb").exists()


# -- a real run ---------------------------------------------------------------------------------------
def read_wandb_file(path: str) -> list:
    """Records of a .wandb transaction log (LevelDB log format: 7-byte file header, 32 KiB blocks
    of [crc32, length, type] chunks), decoded with wandb's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracked")
    os.environ["WANDB_MODE"] = "offline"  # inherited by the run; restored below
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        # DP 2: both ranks run training.setup, only the logging rank may create a W&B run / event file;
        # every timer on (ZeRO-1 for params-all-gather, saves for save-checkpoint)
        records, proc = run_pretrain(2, BASE + [
            "--wandb-project", "megalite-test", "--wandb-exp-name", "tracked", "--wandb-save-dir", str(tmp / "wb"),
            "--tensorboard-dir", str(tmp / "tb"), "--timing-log-level", "2", "--log-timers-to-tensorboard",
            "--use-distributed-optimizer", "--save", str(tmp / "ck"), "--save-interval", "2",
            # an MoE model over EP 2: its losses and tokens per expert are tracked too
            "--disable-bias-linear", "--num-experts", "2", "--moe-router-topk", "1", "--moe-aux-loss-coeff", "1e-2",
            "--expert-model-parallel-size", "2"], tmp, "tracked")
    finally:
        os.environ.pop("WANDB_MODE")
    train = {r["iteration"]: r for r in records if "consumed_samples" in r}
    evals = {(r["split"], r["iteration"]): r for r in records if "split" in r}
    assert sorted(train) == [2, 4] and all(math.isfinite(r["lm_loss"]) for r in train.values())
    timers = [r for r in records if r.get("event") == "timers"]
    return tmp, train, evals, timers, proc.stdout


def test_wandb_offline_run_holds_the_metrics(tracked_run):
    tmp, train, evals, timers, _ = tracked_run
    runs = glob.glob(str(tmp / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs  # one rank logged
    records = read_wandb_file(runs[0])
    kinds = [r.WhichOneof("record_type") for r in records]
    (run,) = [r.run for r, k in zip(records, kinds) if k == "run"]
    assert run.project == "megalite-test" and run.display_name == "tracked"
    history = {}
    for r, k in zip(records, kinds):
        if k == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(row)
    assert {2, 4} <= set(history)
    for it, rec in train.items():
        for key in ("lm_loss", "lr", "grad_norm", "tokens_per_sec", "consumed_samples", "tflops_per_gpu",
                    "load_balancing_loss", "expert_tokens_max"):
            assert history[it][f"train/{key}"] == pytest.approx(rec[key], rel=1e-9), (it, key)
    assert history[2]["valid/lm_loss"] == pytest.approx(evals[("valid", 2)]["lm_loss"], rel=1e-9)
    assert history[4]["test/ppl"] == pytest.approx(evals[("test", 4)]["ppl"], rel=1e-9)
    assert history[4]["timers/optimizer"] == pytest.approx(timers[2]["optimizer"]["max"], rel=1e-9)
    config = {i.key: json.loads(i.value_json) for r, k in zip(records, kinds) if k == "config" for i in r.config.update}
    model = config["model"]  # the RunConfig record, by section
    assert model["num_layers"] == 2 and model["hidden_size"] == 64 and model["padded_vocab_size"] == 1024
    assert config["parallel"]["data_parallel_size"] == 2 and config["optimizer"]["params_dtype"] == "float32"


def test_tensorboard_event_files_hold_the_scalars(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tmp, train, evals, timers, _ = tracked_run
    files = glob.glob(str(tmp / "tb" / "events.out.tfevents.*"))
    assert len(files) == 1, files  # one rank logged
    acc = EventAccumulator(str(tmp / "tb"))
    acc.Reload()
    loss = acc.Scalars("train/lm_loss")
    assert [e.step for e in loss] == sorted(train)
    for e in loss:  # TensorBoard stores float32
        assert e.value == pytest.approx(train[e.step]["lm_loss"], rel=1e-6)
    assert [e.step for e in acc.Scalars("valid/lm_loss")] == [2, 4]
    lb = acc.Scalars("train/load_balancing_loss")
    assert [e.value for e in lb] == pytest.approx([train[e.step]["load_balancing_loss"] for e in lb], rel=1e-6)
    # per MoE layer: the fewest and most tokens an expert got (2 experts, top-1: 4 x 32 tokens a step)
    for layer in (0, 1):
        low, high = acc.Scalars(f"moe/layer_{layer}_tokens_min"), acc.Scalars(f"moe/layer_{layer}_tokens_max")
        assert [e.step for e in high] == [2, 4] and all(a.value + b.value == 128 for a, b in zip(low, high))
    assert acc.Scalars("train/tokens_per_sec")[-1].value == pytest.approx(train[4]["tokens_per_sec"], rel=1e-6)
    (config,) = acc.Tensors("config/text_summary")
    text = config.tensor_proto.string_val[0].decode()
    assert "| model.num_layers | 2 |" in text and "| model.padded_vocab_size | 1024 |" in text
    # --log-timers-to-tensorboard: timers/<name>, the max over ranks (the JSONL's), at each log and save
    for name in ("iteration-time", *INTERVAL_TIMERS, "save-checkpoint"):
        want = [(r["iteration"], r[name] if name == "iteration-time" else r[name]["max"]) for r in timers if name in r]
        got = [(e.step, e.value) for e in acc.Scalars(f"timers/{name}")]
        assert [s for s, _ in got] == [2, 4] and [s for s, _ in want] == [2, 4], name
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), name


def test_timers_block_and_records(tracked_run):
    """--timing-log-level 2 on 2 ranks: Megatron-LM's block under each log line (every interval
    timer, min <= max), save-checkpoint's after each save, and the same values in 'timers' records."""
    _, train, _, timers, stdout = tracked_run
    blocks = re.findall(r"\(min, max\) time across ranks \(ms\):\n((?:    .*\n?)+)", stdout)
    parsed = [[re.fullmatch(r"    (\S+) \.+: \(([\d.]+), ([\d.]+)\)", line).groups() for line in b.splitlines()]
              for b in blocks]
    names = [[n for n, _, _ in b] for b in parsed]
    assert names == [list(INTERVAL_TIMERS), ["save-checkpoint"]] * 2, names
    assert all(0 <= float(lo) <= float(hi) for b in parsed for _, lo, hi in b)
    assert [(r["iteration"], [k for k in r if k not in ("event", "iteration", "iteration-time")]) for r in timers] == [
        (2, list(INTERVAL_TIMERS)), (2, ["save-checkpoint"]), (4, list(INTERVAL_TIMERS)), (4, ["save-checkpoint"])]
    for r, b in zip(timers, parsed):
        assert [(n, f"{r[n]['min']:.2f}", f"{r[n]['max']:.2f}") for n, _, _ in b] == b
    assert [r["iteration-time"] for r in timers if "iteration-time" in r] == [train[2]["elapsed_ms"],
                                                                             train[4]["elapsed_ms"]]
    # nested as Megatron-LM's: on each rank forward-backward holds batch-generator and all-grads-sync,
    # optimizer holds params-all-gather; so do the min and the max over ranks
    for r in (r for r in timers if "optimizer" in r):
        fb, bg, ags = r["forward-backward"], r["batch-generator"], r["all-grads-sync"]
        assert fb["min"] >= bg["min"] + ags["min"] and fb["max"] >= max(bg["max"], ags["max"]), r
        assert r["optimizer"]["min"] >= r["params-all-gather"]["min"], r
        assert r["optimizer"]["max"] >= r["params-all-gather"]["max"], r
