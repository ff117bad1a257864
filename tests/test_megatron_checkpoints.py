"""Megatron-LM checkpoint formats: the torch_dist file format read and written without
megatron-core (checked against torch.distributed.checkpoint's own reader), and pickles that
would run code refused with one line naming the file."""
import os
import pickle

import pytest
import torch

from megalite.checkpoint.megatron_format import DistCheckpoint, write_metadata, write_rank_file
from megalite.checkpoint.safe_pickle import UnsafePickle, load_pickle, torch_load


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_crafted_pickles_are_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": _RunsCode()}))
    torch.save({"args": _RunsCode()}, tmp_path / "common.pt")
    for read, name in ((load_pickle, ".metadata"), (torch_load, "common.pt")):
        with pytest.raises(UnsafePickle) as e:
            read(str(tmp_path / name))
        msg = str(e.value)
        assert "\n" not in msg and name in msg and "system" in msg
    assert not (tmp_path / "pwned.txt").exists()


def test_dist_format_roundtrip_against_torch_dcp(tmp_path):
    """Two 'ranks' write chunks of global tensors (a row split, a column split, a stacked layer
    axis); torch's DCP reader sees the same global tensors, and our reader reads regions and flat
    ranges that cross chunk boundaries from the overlapping chunks only."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(6, 4, generator=g), "b": torch.randn(2, 5, 6, generator=g),
            "c": torch.arange(7, dtype=torch.int64)}
    r0 = [("a", (6, 4), (0, 0), full["a"][:3]), ("b", (2, 5, 6), (0, 0, 0), full["b"][:, :, :3]),
          ("c", (7,), (0,), full["c"])]
    r1 = [("a", (6, 4), (3, 0), full["a"][3:]), ("b", (2, 5, 6), (0, 0, 3), full["b"][:, :, 3:])]
    recs = write_rank_file(str(tmp_path), 0, r0, {"obj/shard_0_1": {"x": 1}}) + write_rank_file(str(tmp_path), 1, r1)
    write_metadata(str(tmp_path), recs, {"iteration": 5})
    dcp_to_torch_save(str(tmp_path), str(tmp_path / "ref.pt"))
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    ckpt = DistCheckpoint(str(tmp_path))
    for k, t in full.items():
        assert torch.equal(ref[k], t) and torch.equal(ckpt.read(k), t)
        assert torch.equal(ckpt.read_flat(k, 2, t.numel() - 1), t.reshape(-1)[2:-1])
    assert torch.equal(ckpt.read("b", ((1, 2), (1, 4), (2, 5))), full["b"][1:2, 1:4, 2:5])
    assert ckpt.read_object("obj/shard_0_1") == {"x": 1} and ckpt.common() == {"iteration": 5}
    assert ckpt.keys()["b"] == ((2, 5, 6), torch.float32)
