"""The data source and the tokenizer flags, without reading any file (arguments/paths.py reads)."""
from __future__ import annotations

from ..config.data import DEFAULT_SPLIT
from ..config.run import RunConfig
from ..data.data_paths import parse_and_normalize_split, parse_blend
from ..data.tokenizers import check_tokenizer_args
from ..errors import InputError
from .errors import fail, flag

# flags whose effect is on documents: nothing to act on in uniform random tokens
_DOCUMENT_FLAGS = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")
DATA_PATHS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def check_data(c: RunConfig) -> None:
    d, tok = c.data, c.tokenizer
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        fail("--reset-attention-mask needs the document boundaries the data loader builds in place of an "
             "attention mask (documents may not attend to each other), which --no-create-attention-mask-in-dataloader "
             "turns off; drop one of them (Megatron-LM would silently attend across documents)")
    paths = {dest: getattr(d, dest) for dest in DATA_PATHS}
    given = [dest for dest, v in paths.items() if v is not None]
    if tok.tokenizer_type is None and (tok.vocab_file or tok.merge_file or (given and not d.mock_data)):
        # Megatron-LM's pretrain_gpt.py: args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}
        tok.tokenizer_type = "GPT2BPETokenizer"
        c.notices.append("--tokenizer-type not given: GPT2BPETokenizer, Megatron-LM's pretrain_gpt.py default")
    try:
        c.notices.extend(check_tokenizer_args(tok))
    except InputError as e:
        fail(str(e))
    if d.fim_data and d.mock_data:
        fail("--fim-data needs documents and a tokenizer (it cuts each document's text): give a dataset instead of "
             "--mock-data")
    if d.fim_data and (not d.fim_rate or not d.fim_spm_rate):
        fail("--fim-data needs --fim-rate and --fim-spm-rate above 0 (Megatron-LM asserts them)")
    if d.mock_data:
        _check_mock(c, given)
        return
    if not given:
        fail("no training data: give --data-path (or --train-data-path ...) or --mock-data")
    for dest in given:
        if not paths[dest]:
            fail(f"{flag(dest)} needs at least one dataset prefix")
        try:
            parse_blend(paths[dest], flag(dest))
        except InputError as e:
            fail(str(e))
    if d.data_path is not None and len(given) > 1:
        fail(f"use either --data-path with --split or --train/valid/test-data-path, not both "
             f"(got --data-path and {flag(given[1])})")
    if d.data_path is None and d.split != DEFAULT_SPLIT:
        fail("--split applies to --data-path only; --train/valid/test-data-path are used whole")
    try:
        parse_and_normalize_split(d.split)
    except InputError as e:
        fail(str(e))
    if tok.tokenizer_type is None:
        fail("--tokenizer-type is required with a dataset (it gives the vocabulary and the end-of-document id)")
    if d.train_data_path is None and d.data_path is None:
        fail("no training data: --valid-data-path / --test-data-path need --train-data-path")


def _check_mock(c: RunConfig, given: list[str]) -> None:
    d = c.data
    if given:
        fail(f"--mock-data cannot be combined with {flag(given[0])}: mock data replaces the dataset")
    if c.tokenizer.vocab_size is None and c.tokenizer.tokenizer_type is None:
        fail("--mock-data needs --vocab-size (or a --tokenizer-type, whose vocabulary is used)")
    # refused rather than ignored: each would change nothing, and a user who sets one expects it to
    for dest in _DOCUMENT_FLAGS:
        if getattr(d, dest):
            fail(f"{flag(dest)} has no effect with --mock-data: mock samples are uniform random tokens "
                 f"with no end-of-document markers; drop it, or train on a dataset (--data-path)")
    # Megatron-LM's flags that it accepts and ignores with mock data (its Llama-3 script passes
    # them): a notice each, and the run goes on
    ignored = [(d.split != DEFAULT_SPLIT, "--split", "there is no dataset to split"),
               (bool(d.data_cache_path), "--data-cache-path", "mock data builds no index"),
               (not d.mmap_bin_files, "--no-mmap-bin-files", "there are no .bin files to read")]
    c.notices.extend(f"{name} has no effect with --mock-data ({why}; Megatron-LM accepts and ignores it there)"
                     for given_here, name, why in ignored if given_here)
