"""GPTDataset indices against brute force, caching, splits and blending."""

import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from megalite.data.blended_dataset import build_blending_indices
from megalite.data.builder import (build_train_valid_test_datasets, parse_and_normalize_split,
                                   split_document_ranges)
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def make_dataset(prefix, lengths, base=0, seed=0):
    """Documents of the given lengths; token values encode (document, position) for easy checks."""
    rng = np.random.RandomState(seed)
    b = IndexedDatasetBuilder(str(prefix) + ".bin", np.int32)
    docs = []
    for n in lengths:
        d = base + rng.randint(0, 1000, size=n)
        docs.append(d)
        b.add_document(d)
    b.finalize(str(prefix) + ".idx")
    return docs


def args(tmp_path, **kw):
    a = dict(data_path=None, split="969,30,1", data_cache_path=str(tmp_path / "cache"), train_data_path=None,
             valid_data_path=None, test_data_path=None, seq_length=8, seed=1234)
    a.update(kw)
    return SimpleNamespace(**a)


LENGTHS = [5, 0, 13, 1, 7, 22, 3, 9, 0, 11, 4, 17]


# -- Megatron-LM's rules, written out independently of megalite's code ------------------------------
def megatron_num_epochs(tokens_per_epoch, seq_length, num_samples):
    """_get_num_epochs: add epochs until num_samples samples (and the last label) fit."""
    epochs = 1
    while num_samples is not None and (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    return epochs


def megatron_samples_before_separate_final_epoch(tokens_per_epoch, seq_length, num_samples):
    """The number of samples shuffled apart from a final epoch that is used for less than 80 %,
    or None when the final epoch is shuffled with the others."""
    epochs = megatron_num_epochs(tokens_per_epoch, seq_length, num_samples)
    if epochs == 1:
        return None
    before = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return before if num_samples - before < int(0.80 * per_epoch) else None


def megatron_split(weights, n):
    """get_train_valid_test_split_: round each split's size, then shift every boundary by the total
    rounding excess so that the last ends at n."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(n))))
    excess = bounds[-1] - n
    bounds = [0] + [b - excess for b in bounds[1:]]
    return [None if w == 0 else (lo, hi) for w, lo, hi in zip(weights, bounds, bounds[1:])]


@pytest.mark.parametrize("num_samples", [None, 5, 30, 80])
def test_samples_match_brute_force(tmp_path, num_samples):
    docs = make_dataset(tmp_path / "d", LENGTHS)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "d")), 2, 11, num_samples, 8, 7, str(tmp_path / "c"))
    s = 8
    # The document index holds whole epochs of exactly the split's documents, as many as Megatron's rule asks.
    n_epochs = megatron_num_epochs(sum(LENGTHS[2:11]), s, num_samples)
    assert sorted(ds.document_index.tolist()) == sorted(list(range(2, 11)) * n_epochs)
    stream = np.concatenate([docs[d] for d in ds.document_index])
    assert len(ds) == (len(stream) - 1) // s
    if num_samples is not None:
        assert len(ds) >= num_samples
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        item = ds[i]["text"]
        assert item.dtype == np.int64 and item.shape == (s + 1,)
        np.testing.assert_array_equal(item, stream[k * s:k * s + s + 1])


def test_document_index_is_megatron_shuffle(tmp_path):
    make_dataset(tmp_path / "d", LENGTHS)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "d")), 0, 12, None, 8, 99, str(tmp_path / "c"))
    expected = np.arange(12, dtype=np.int32)
    np.random.RandomState(99).shuffle(expected)
    np.testing.assert_array_equal(ds.document_index, expected)


@pytest.mark.parametrize("num_samples", [14, 22, 30])
def test_separate_final_epoch(tmp_path, num_samples):
    # 10 docs x 10 tokens = 100 tokens/epoch = 12 samples of 8. 14 or 30 samples use the final
    # epoch for < 80 %: it is shuffled on its own; 22 uses it for more: one shuffle over all.
    make_dataset(tmp_path / "d", [10] * 10)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "d")), 0, 10, num_samples, 8, 3, str(tmp_path / "c"))
    epochs = megatron_num_epochs(100, 8, num_samples)
    before = megatron_samples_before_separate_final_epoch(100, 8, num_samples)
    assert len(ds.document_index) == 10 * epochs and len(ds) == (100 * epochs - 1) // 8
    if before is None:
        assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
        assert max(ds.shuffle_index[:before or 12]) >= 12  # not held back: later epochs mix in early
    else:
        # the earlier epochs are shuffled together, the final epoch on its own
        assert sorted(ds.document_index[:10 * (epochs - 1)].tolist()) == sorted(list(range(10)) * (epochs - 1))
        assert sorted(ds.document_index[10 * (epochs - 1):].tolist()) == list(range(10))
        # the samples of the earlier epochs are served first, shuffled among themselves
        assert sorted(ds.shuffle_index[:before].tolist()) == list(range(before))
        assert sorted(ds.shuffle_index[before:].tolist()) == list(range(before, len(ds)))


def test_same_seed_same_order_and_cache_reuse(tmp_path, monkeypatch):
    make_dataset(tmp_path / "d", LENGTHS)
    idx = IndexedDataset(str(tmp_path / "d"))
    a = GPTDataset(idx, 0, 12, 40, 8, 5, str(tmp_path / "c1"))
    b = GPTDataset(idx, 0, 12, 40, 8, 5, str(tmp_path / "c2"))  # fresh build elsewhere
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    files = sorted(os.listdir(tmp_path / "c1"))
    assert len([f for f in files if f.endswith(".npy")]) == 3 and not any(".tmp" in f for f in files)
    mtimes = {f: os.stat(tmp_path / "c1" / f).st_mtime_ns for f in files}

    def no_rebuild(self):
        raise AssertionError("cache was not reused")

    monkeypatch.setattr(GPTDataset, "_build_indices", no_rebuild)
    c = GPTDataset(idx, 0, 12, 40, 8, 5, str(tmp_path / "c1"))
    assert {f: os.stat(tmp_path / "c1" / f).st_mtime_ns for f in files} == mtimes
    assert isinstance(c.sample_index, np.memmap)
    assert all(np.array_equal(a[i]["text"], c[i]["text"]) for i in range(len(a)))
    # Any input that changes the indices changes the cache key: a new build is required.
    for kwargs in [dict(seed=6), dict(seq_length=7), dict(num_samples=41)]:
        p = dict(num_samples=40, seq_length=8, seed=5)
        p.update(kwargs)
        with pytest.raises(AssertionError, match="not reused"):
            GPTDataset(idx, 0, 12, p["num_samples"], p["seq_length"], p["seed"], str(tmp_path / "c1"))
    monkeypatch.undo()
    d = GPTDataset(idx, 0, 12, 40, 8, 6, str(tmp_path / "c1"))
    assert not np.array_equal(a.shuffle_index, d.shuffle_index)
    # Pickling (DataLoader workers) reopens the cached maps.
    e = pickle.loads(pickle.dumps(c))
    assert np.array_equal(e[3]["text"], c[3]["text"])


def test_split_parsing_and_ranges():
    assert parse_and_normalize_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_and_normalize_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    for bad in ["a,b", "1,2,3,4", "0,0,0", "-1,2"]:
        with pytest.raises(ValueError, match="--split"):
            parse_and_normalize_split(bad)
    # Megatron-LM's boundaries, so that a --split gives the same documents in both
    for split in ["6,3,1", "969,30,1", "98,2,0", "1,1,1", "80,15,5"]:
        weights = parse_and_normalize_split(split)
        for n in [1, 3, 7, 25, 49, 100, 113, 12345]:
            assert split_document_ranges(weights, n) == megatron_split(weights, n), (split, n)
    assert split_document_ranges([0.5, 0.5, 0.0], 10) == [(0, 5), (5, 10), None]


def test_builder_splits_are_disjoint_and_contiguous(tmp_path):
    make_dataset(tmp_path / "d", [20] * 100)
    a = args(tmp_path, data_path=[str(tmp_path / "d")], split="80,15,5")
    tr, va, te = build_train_valid_test_datasets(a, (300, 50, 10))
    for ds, (lo, hi) in zip((tr, va, te), megatron_split([0.8, 0.15, 0.05], 100)):
        assert (ds.documents[0], ds.documents[-1]) == (lo, hi - 1)
    assert len(tr) >= 300 and len(va) >= 50 and len(te) >= 10
    assert set(np.unique(va.document_index)) == set(range(80, 95))
    # A split of weight 0 (or asking for 0 samples) gives None.
    tr, va, te = build_train_valid_test_datasets(args(tmp_path, data_path=[str(tmp_path / "d")], split="9,1,0"),
                                                 (10, 0, 10))
    assert tr is not None and va is None and te is None


def test_builder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--data-path .*nope.*nope\.bin"):
        build_train_valid_test_datasets(args(tmp_path, data_path=[str(tmp_path / "nope")]), (1, 1, 1))
    make_dataset(tmp_path / "d", [5] * 3)
    with pytest.raises(ValueError, match="fewer than one sample"):
        build_train_valid_test_datasets(args(tmp_path, data_path=[str(tmp_path / "d")], seq_length=64, split="1,0,0"),
                                        (1, 0, 0))
    with pytest.raises(ValueError, match="no training data"):
        build_train_valid_test_datasets(args(tmp_path), (1, 1, 1))


def test_blending_indices_proportions():
    w = [0.5, 0.3, 0.2]
    di, dsi = build_blending_indices(w, 10000)
    di2, dsi2 = build_blending_indices(w, 10000)
    assert np.array_equal(di, di2) and np.array_equal(dsi, dsi2)
    onehot = np.eye(3)[di]
    counts = np.cumsum(onehot, axis=0)  # [n, 3]: samples of each dataset among the first n+1
    n = np.arange(1, 10001)[:, None]
    assert np.abs(counts - n * np.array(w)).max() <= 2.0
    # The k-th sample of dataset i is its sample k: indices run 0, 1, 2, ... per dataset.
    for i in range(3):
        assert dsi[di == i].tolist() == list(range(int((di == i).sum())))
    # A prefix of a larger blend is the smaller blend (growing the run never reorders the past).
    di_small, _ = build_blending_indices(w, 777)
    assert np.array_equal(di_small, di[:777])


def test_blended_datasets_weighted_and_by_tokens(tmp_path):
    make_dataset(tmp_path / "a", [30] * 40, base=0)
    make_dataset(tmp_path / "b", [30] * 20, base=5000)  # tokens of b are >= 5000, of a < 1000
    a = args(tmp_path, data_path=["0.25", str(tmp_path / "a"), "0.75", str(tmp_path / "b")], split="1,0,0")
    tr, va, te = build_train_valid_test_datasets(a, (400, 0, 0))
    assert len(tr) == 400 and va is None and te is None
    from_b = np.array([tr[i]["text"].min() >= 5000 for i in range(400)])
    assert all(tr[i]["text"].max() < 1000 for i in np.flatnonzero(~from_b))
    assert from_b.sum() == pytest.approx(0.75 * 400, abs=2)
    assert np.array_equal(np.asarray(tr.dataset_index) == 1, from_b)
    tr2, _, _ = build_train_valid_test_datasets(a, (400, 0, 0))
    assert all(np.array_equal(tr[i]["text"], tr2[i]["text"]) for i in range(0, 400, 37))
    # Without weights: proportional to tokens
    a = args(tmp_path, data_path=[str(tmp_path / "a"), str(tmp_path / "b")], split="1,0,0")
    tr, _, _ = build_train_valid_test_datasets(a, (300, 0, 0))
    tokens_a, tokens_b = 30 * 40, 30 * 20
    assert int((np.asarray(tr.dataset_index) == 0).sum()) == pytest.approx(300 * tokens_a / (tokens_a + tokens_b), abs=2)


def test_per_split_data_paths(tmp_path):
    make_dataset(tmp_path / "a", [30] * 10, base=0)
    make_dataset(tmp_path / "b", [30] * 10, base=5000)
    a = args(tmp_path, train_data_path=[str(tmp_path / "a")], valid_data_path=[str(tmp_path / "b")])
    tr, va, te = build_train_valid_test_datasets(a, (50, 20, 5))
    assert te is None
    assert (tr.documents[0], tr.documents[-1]) == (0, 9) and (va.documents[0], va.documents[-1]) == (0, 9)
    assert va[0]["text"].min() >= 5000 and tr[0]["text"].max() < 1000
    with pytest.raises(ValueError, match="not both"):
        build_train_valid_test_datasets(args(tmp_path, data_path=[str(tmp_path / "a")],
                                             train_data_path=[str(tmp_path / "a")]), (1, 1, 1))


def test_default_cache_dir_beside_data(tmp_path):
    make_dataset(tmp_path / "d", [20] * 10)
    a = args(tmp_path, data_path=[str(tmp_path / "d")], data_cache_path=None, split="1,0,0")
    build_train_valid_test_datasets(a, (10, 0, 0))
    assert any(f.endswith("GPTDataset-sample_index.npy") for f in os.listdir(tmp_path / "cache"))
