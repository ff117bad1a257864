"""Megatron-LM's memory-mapped indexed dataset (``MMapIndexedDataset``), byte for byte.

A dataset is a pair of files sharing a prefix:

``{prefix}.bin``  token arrays of every sequence, concatenated, no header.
``{prefix}.idx``  little-endian index::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (see DTYPE_CODES)
    u64       S, number of sequences
    u64       D, number of document boundaries (= documents + 1)
    i32[S]    sequence lengths, in tokens
    i64[S]    byte offset of each sequence in .bin
    i64[D]    document boundaries: sequence ids, starting at 0 and ending at S

Keeping the layout identical means corpora preprocessed by Megatron-LM, GPT-NeoX or NeMo load
here unchanged, and ours load there. Both files are memory-mapped: opening a dataset costs the same
for 1 MB and 1 TB, and nothing here reads a whole file into memory. With ``mmap=False``
(--no-mmap-bin-files, as Megatron-LM's _FileBinReader) the ``.bin`` is not mapped: each read is
one positioned read (os.pread) of just the tokens asked for, for file systems where mmap is slow.
"""

from __future__ import annotations

import os
import struct
from array import array

import numpy as np

from megalite.errors import InputError, InputNotFound

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
# magic, version (u64), dtype code (u8), sequence count (u64), document count (u64)
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def best_dtype(vocab_size: int) -> type:
    """Smallest token dtype that holds every id of a vocabulary (Megatron's rule)."""
    # Megatron keeps a margin below 65536 (65500), so the same corpora get the same dtype.
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def write_index(idx_path: str, dtype, sequence_lengths, document_indices) -> None:
    """Write an ``.idx`` file from whole arrays (used by the builder and by benchmarks)."""
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        raise ValueError(f"{idx_path}: unsupported token dtype {dtype}; use one of "
                         f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    docs = np.asarray(document_indices, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"{idx_path}: negative sequence length")
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{idx_path}: a sequence longer than 2**31-1 tokens cannot be indexed")
    if docs.size == 0 or docs[0] != 0 or docs[-1] != lengths.size:
        raise ValueError(f"{idx_path}: document indices must start at 0 and end at the "
                         f"sequence count {lengths.size}")
    # Byte offsets are an exclusive prefix sum of the sequence sizes in bytes.
    offsets = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=offsets[1:])
    with open(idx_path, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, _VERSION, _CODE_OF_DTYPE[dtype], lengths.size, docs.size))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(offsets.astype("<i8").tobytes(order="C"))
        f.write(docs.astype("<i8").tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams token arrays into ``.bin``; ``finalize`` writes the matching ``.idx``.

    Usage: ``add_item`` one or more sequences, then ``end_document()``; or ``add_document`` to do
    both. Only the per-sequence lengths stay in memory (4 bytes each, in a compact ``array``).
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"{bin_path}: unsupported token dtype {self.dtype}")
        self._file = open(bin_path, "wb")
        self._lengths = array("q")
        self._doc_indices = array("q", [0])
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._lo, self._hi = int(info.min), int(info.max)
        else:
            self._lo = self._hi = None

    def add_item(self, tokens) -> None:
        """Append one sequence (a 1-D array of token ids)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"{self.bin_path}: expected a 1-D token array, got shape {tokens.shape}")
        if tokens.size and self._lo is not None:
            lo, hi = int(tokens.min()), int(tokens.max())
            # Silent wrap-around (e.g. id 70000 into uint16) would corrupt the corpus.
            if lo < self._lo or hi > self._hi:
                raise InputError(f"{self.bin_path}: token id range [{lo}, {hi}] does not fit "
                                 f"dtype {self.dtype}; use a wider dtype (see best_dtype)")
        self._file.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(tokens.size)

    def end_document(self) -> None:
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens, lengths=None) -> None:
        """Append one document: ``tokens`` split into sequences of ``lengths`` (default: one)."""
        tokens = np.asarray(tokens)
        if lengths is None:
            self.add_item(tokens)
        else:
            if sum(lengths) != tokens.size:
                raise ValueError(f"{self.bin_path}: sequence lengths {list(lengths)} do not sum to "
                                 f"the document's {tokens.size} tokens")
            start = 0
            for n in lengths:
                self.add_item(tokens[start:start + n])
                start += n
        self.end_document()

    def add_documents(self, tokens, sequence_lengths, sequences_per_document) -> None:
        """Append many documents in one write: `tokens` (1-D) holds `sequence_lengths` sequences back
        to back, and document i is the next `sequences_per_document[i]` of them. The same bytes as
        calling add_document for each, at a fraction of the per-call cost (preprocessing batches)."""
        tokens, lengths = np.asarray(tokens), np.asarray(sequence_lengths, dtype=np.int64)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64)
        if int(lengths.sum()) != tokens.size or int(per_doc.sum()) != lengths.size:
            raise ValueError(f"{self.bin_path}: {tokens.size} tokens, {lengths.size} sequence lengths summing to "
                             f"{int(lengths.sum())}, documents of {int(per_doc.sum())} sequences: inconsistent")
        self.add_item(tokens)  # one write, one range check
        self._lengths.pop()
        self._lengths.extend(lengths.tolist())
        self._doc_indices.extend((self._doc_indices[-1] + np.cumsum(per_doc)).tolist())

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        write_index(idx_path, self.dtype, np.frombuffer(self._lengths, dtype=np.int64),
                    np.frombuffer(self._doc_indices, dtype=np.int64))


class IndexedDataset:
    """Read-only view of ``{path_prefix}.bin/.idx``; ``ds[i]`` is sequence ``i`` as a NumPy array.
    Implements reader.DatasetReader (the contract of each member is written there).

    Arrays returned by ``ds[i]``/``ds.get`` are read-only views into the memory map; copy them
    before modifying.
    """

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix, self.mmap = path_prefix, mmap
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise InputNotFound(f"indexed dataset '{self.path_prefix}': missing file {p} "
                                        f"(a dataset is a .bin/.idx pair; see tools/preprocess_data.py)")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER.size)
        if len(header) < 9 or header[:9] != _MAGIC:
            raise InputError(f"{idx_path}: not a Megatron indexed-dataset index (bad magic "
                             f"{header[:9]!r}, expected {_MAGIC!r})")
        if len(header) < _HEADER.size:
            raise InputError(f"{idx_path}: truncated header ({idx_size} bytes, need {_HEADER.size})")
        _, version, code, num_seqs, num_docs = _HEADER.unpack(header)
        if version != _VERSION:
            raise InputError(f"{idx_path}: unsupported index version {version} (expected {_VERSION})")
        if code not in DTYPE_CODES:
            raise InputError(f"{idx_path}: unknown dtype code {code} (expected one of {sorted(DTYPE_CODES)})")
        expected = _HEADER.size + num_seqs * (4 + 8) + num_docs * 8
        if idx_size < expected:
            raise InputError(f"{idx_path}: truncated index: {idx_size} bytes, but its header "
                             f"({num_seqs} sequences, {num_docs} document boundaries) needs {expected}")
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buf, off = self._idx_map, _HEADER.size
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=num_seqs, offset=off)
        off += num_seqs * 4
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=num_seqs, offset=off)
        off += num_seqs * 8
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=num_docs, offset=off)
        if num_docs < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != num_seqs:
            raise InputError(f"{idx_path}: corrupt document indices (must start at 0 and end at "
                             f"the sequence count {num_seqs})")

        bin_size = os.path.getsize(bin_path)
        needed = 0
        if num_seqs:
            needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if bin_size < needed:
            raise InputError(f"{bin_path}: data file is {bin_size} bytes but {idx_path} addresses "
                             f"{needed} bytes (truncated .bin, or .bin/.idx from different runs)")
        # mmap cannot map an empty file; an empty dataset simply has no data buffer.
        self._bin_map = None
        if self.mmap:
            self._bin_map = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.empty(0, np.uint8)
        self._bin_fd, self._bin_fd_pid = None, None

    # Memory maps must not be pickled (that would copy the data): DataLoader workers reopen.
    def __getstate__(self):
        return {"path_prefix": self.path_prefix, "mmap": self.mmap}

    def __setstate__(self, state):
        self.path_prefix, self.mmap = state["path_prefix"], state.get("mmap", True)
        self._open()

    def _read(self, ptr: int, count: int) -> np.ndarray:
        """`count` tokens at byte `ptr` of the .bin: a view of the map, or one positioned read
        (pread does not move a shared file offset, so forked loader workers cannot interfere)."""
        if self._bin_map is not None:
            return np.frombuffer(self._bin_map, dtype=self.dtype, count=count, offset=ptr)
        if self._bin_fd_pid != os.getpid():
            self._bin_fd, self._bin_fd_pid = os.open(data_file_path(self.path_prefix), os.O_RDONLY), os.getpid()
        nbytes = count * self.dtype.itemsize
        data = os.pread(self._bin_fd, nbytes, ptr)
        if len(data) != nbytes:
            raise InputError(f"{data_file_path(self.path_prefix)}: short read at byte {ptr} (file changed?)")
        return np.frombuffer(data, dtype=self.dtype, count=count)

    def head(self, count: int) -> np.ndarray:
        """The first `count` tokens of the .bin (for checks)."""
        return self._read(0, count)

    def cache_stamp(self) -> int:
        """The .idx file's size (what GPTDataset's cache key has always recorded as idx_size)."""
        return os.path.getsize(index_file_path(self.path_prefix))

    def __len__(self) -> int:
        return self.sequence_lengths.shape[0]

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        raise TypeError(f"indices must be integers or slices, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` without reading the rest."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.path_prefix}")
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                             f"of length {seq_len} in {self.path_prefix}")
        ptr = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return self._read(ptr, length)

    @property
    def num_documents(self) -> int:
        return self.document_indices.shape[0] - 1
