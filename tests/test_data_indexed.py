"""Megatron .bin/.idx format: round trip, byte layout built by hand, and clear errors."""

import pickle
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype


def _write(prefix, docs, dtype):
    """docs: list of documents, each a list of sequences (lists of ints)."""
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(np.array(seq))
        b.end_document()
    b.finalize(str(prefix) + ".idx")
    return IndexedDataset(str(prefix))


DOCS = [[[1, 2, 3]], [[4], [5, 6, 7, 8]], [[]], [[9, 10]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_round_trip(tmp_path, dtype):
    ds = _write(tmp_path / "d", DOCS, dtype)
    seqs = [s for d in DOCS for s in d]
    assert len(ds) == 5
    assert ds.dtype == np.dtype(dtype)
    assert ds.sequence_lengths.tolist() == [3, 1, 4, 0, 2]
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5]
    assert ds.num_documents == 4
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
        assert ds[i].dtype == np.dtype(dtype)
    assert ds.get(2, offset=1, length=2).tolist() == [6, 7]
    assert ds.get(2, offset=3).tolist() == [8]
    assert ds[-1].tolist() == [9, 10]
    assert [a.tolist() for a in ds[1:3]] == [[4], [5, 6, 7, 8]]
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    # Pickling (DataLoader workers) reopens the maps instead of copying data.
    ds2 = pickle.loads(pickle.dumps(ds))
    assert ds2[2].tolist() == [5, 6, 7, 8]
    assert len(pickle.dumps(ds)) < 500


def test_add_document_with_lengths(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    b.add_document(np.array([1, 2, 3, 4, 5]), lengths=[2, 3])
    b.add_document(np.array([6]))
    b.finalize(str(tmp_path / "d.idx"))
    ds = IndexedDataset(str(tmp_path / "d"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3, 4, 5], [6]]
    assert ds.document_indices.tolist() == [0, 2, 3]


def _hand_made(prefix, seqs, docs, code=8, fmt="<H", version=1, magic=b"MMIDIDX\x00\x00"):
    """The byte layout of Megatron's MMapIndexedDataset, written with struct only."""
    itemsize = struct.calcsize(fmt)
    lengths = [len(s) for s in seqs]
    offsets, off = [], 0
    for n in lengths:
        offsets.append(off)
        off += n * itemsize
    idx = magic + struct.pack("<Q", version) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(docs))
    idx += struct.pack(f"<{len(seqs)}i", *lengths)
    idx += struct.pack(f"<{len(seqs)}q", *offsets)
    idx += struct.pack(f"<{len(docs)}q", *docs)
    data = b"".join(struct.pack(f"<{len(s)}{fmt[1]}", *s) for s in seqs)
    (prefix.parent / (prefix.name + ".idx")).write_bytes(idx)
    (prefix.parent / (prefix.name + ".bin")).write_bytes(data)
    return idx, data


def test_reads_hand_built_files_and_writer_matches_bytes(tmp_path):
    seqs = [[10, 20, 30], [65535, 0], [7]]
    idx, data = _hand_made(tmp_path / "h", seqs, [0, 2, 3])
    ds = IndexedDataset(str(tmp_path / "h"))
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(3)] == seqs
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.sequence_pointers.tolist() == [0, 6, 10]
    # Our writer produces the identical bytes.
    b = IndexedDatasetBuilder(str(tmp_path / "w.bin"), np.uint16)
    b.add_item(np.array(seqs[0]))
    b.add_item(np.array(seqs[1]))
    b.end_document()
    b.add_item(np.array(seqs[2]))
    b.end_document()
    b.finalize(str(tmp_path / "w.idx"))
    assert (tmp_path / "w.idx").read_bytes() == idx
    assert (tmp_path / "w.bin").read_bytes() == data


def test_hand_built_int32(tmp_path):
    _hand_made(tmp_path / "h", [[-5, 100000]], [0, 1], code=4, fmt="<i")
    ds = IndexedDataset(str(tmp_path / "h"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [-5, 100000]


def test_bad_magic(tmp_path):
    _hand_made(tmp_path / "h", [[1]], [0, 1], magic=b"NOTANIDX\x00")
    with pytest.raises(ValueError, match=r"h\.idx.*magic"):
        IndexedDataset(str(tmp_path / "h"))


def test_bad_version(tmp_path):
    _hand_made(tmp_path / "h", [[1]], [0, 1], version=2)
    with pytest.raises(ValueError, match=r"h\.idx.*version 2"):
        IndexedDataset(str(tmp_path / "h"))


def test_bad_dtype_code(tmp_path):
    _hand_made(tmp_path / "h", [[1]], [0, 1], code=42)
    with pytest.raises(ValueError, match=r"h\.idx.*dtype code 42"):
        IndexedDataset(str(tmp_path / "h"))


@pytest.mark.parametrize("keep", [5, 30, 60])
def test_truncated_idx(tmp_path, keep):
    idx, _ = _hand_made(tmp_path / "h", [[1, 2], [3]], [0, 2])
    (tmp_path / "h.idx").write_bytes(idx[:keep])
    with pytest.raises(ValueError, match=r"h\.idx.*(truncated|magic)"):
        IndexedDataset(str(tmp_path / "h"))


def test_short_bin(tmp_path):
    _, data = _hand_made(tmp_path / "h", [[1, 2], [3, 4, 5]], [0, 2])
    (tmp_path / "h.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match=r"h\.bin.*8 bytes.*10"):
        IndexedDataset(str(tmp_path / "h"))


def test_bad_document_indices(tmp_path):
    _hand_made(tmp_path / "h", [[1, 2], [3]], [0, 1])
    with pytest.raises(ValueError, match=r"h\.idx.*document indices"):
        IndexedDataset(str(tmp_path / "h"))


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file(tmp_path, missing):
    _hand_made(tmp_path / "h", [[1]], [0, 1])
    (tmp_path / ("h" + missing)).unlink()
    with pytest.raises(FileNotFoundError, match=r"h" + missing.replace(".", r"\.")):
        IndexedDataset(str(tmp_path / "h"))


def test_empty_dataset(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "e.bin"), np.uint16)
    b.finalize(str(tmp_path / "e.idx"))
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]


def test_token_out_of_dtype_range(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    with pytest.raises(ValueError, match="70000"):
        b.add_item(np.array([1, 70000]))


def test_best_dtype():
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32
