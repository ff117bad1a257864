"""The dataset-reader interface (data/reader.py): the .bin/.idx reader implements it, and
open_dataset picks a format and checks a prefix with one-line errors naming the flag."""
import inspect

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.data.reader import FORMATS, DatasetReader, open_dataset
from megalite.errors import InputError, InputNotFound


def _write(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        b.add_document(np.array(doc, dtype=dtype), [len(doc)])
    b.finalize(prefix + ".idx")


def test_indexed_reader_implements_the_interface(tmp_path):
    prefix = str(tmp_path / "d")
    _write(prefix, [[1, 2, 3], [4, 5], []])
    ds = open_dataset(prefix, "--data-path")
    assert isinstance(ds, IndexedDataset) and isinstance(ds, DatasetReader)
    # every method of the interface, with the interface's parameters
    for name, member in vars(DatasetReader).items():
        if callable(member) and not name.startswith("_"):
            assert list(inspect.signature(getattr(IndexedDataset, name)).parameters) == \
                   list(inspect.signature(member).parameters), name
    # the contract: lengths, document boundaries, token ranges, dtype
    assert len(ds) == 3 and ds.sequence_lengths.tolist() == [3, 2, 0]
    assert ds.document_indices.tolist() == [0, 1, 2, 3] and ds.num_documents == 3
    assert ds.get(0, 1, 2).tolist() == [2, 3] and ds.get(-2).tolist() == [4, 5]
    assert ds.head(4).tolist() == [1, 2, 3, 4] and ds.dtype == np.uint16
    with pytest.raises(IndexError):
        ds.get(1, 1, 2)
    assert ds.cache_stamp() == (tmp_path / "d.idx").stat().st_size


def test_formats_name_their_files():
    assert [f.name for f in FORMATS] == ["indexed"]
    assert FORMATS[0].files("x/y") == ("x/y.bin", "x/y.idx")


def test_open_dataset_errors(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(InputNotFound, match=rf"--data-path {prefix}: dataset not found \(missing {prefix}.bin, "
                                            rf"{prefix}.idx\); a prefix names a .bin/.idx pair"):
        open_dataset(prefix, "--data-path")
    _write(prefix, [[1, 2, 300]])
    with pytest.raises(InputError, match=rf"--train-data-path {prefix}: token id 300 in {prefix}.bin is outside"):
        open_dataset(prefix, "--train-data-path", vocab_size=256)
    (tmp_path / "d.idx").write_bytes(b"garbage")
    with pytest.raises(InputError, match=rf"--data-path {prefix}: {prefix}.idx: not a Megatron indexed-dataset"):
        open_dataset(prefix, "--data-path")
