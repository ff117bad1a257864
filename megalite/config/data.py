"""Where the tokens come from: datasets, splits, mock data, document masks, the loader, and the
tokenizer (whose flags every tool shares: `arguments.parser.add_config_args(parser, TokenizerConfig)`)."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import AT_LEAST_1, at_least_0, derived, flag

IN_0_1_CLOSED = (lambda v: 0 <= v <= 1, "a probability in [0, 1]")

DEFAULT_SPLIT = "969, 30, 1"
# every tool's --tokenizer-type choices: exactly the names of data/tokenizers.py's TOKENIZERS registry
# (tests/test_bad_input.py holds the two equal); written here so that the configs import no data module
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")
TOKENIZER_TYPES_HELP = ("GPTSentencePieceTokenizer is SentencePieceTokenizer under Megatron-LM's name; "
                        "Llama2Tokenizer is SentencePiece with the bos id before each text; "
                        "TikTokenizer reads Megatron-LM's tiktoken vocabulary (a JSON list, --tokenizer-model) "
                        "with --tiktoken-pattern; NullTokenizer reads whitespace-separated ids below --vocab-size N "
                        "and uses N as its end-of-document id")


@dataclass
class DataConfig:
    """data"""
    mock_data: bool = flag(
        "--mock-data", False, "uniform random tokens (seeded) instead of a dataset; the vocabulary comes from "
        "--vocab-size or --tokenizer-type. Refuses the flags that act on documents or dataset files (--split, "
        "--data-cache-path, --eod-mask-loss, --reset-position-ids, --reset-attention-mask)", action="store_true")
    data_path: list[str] | None = flag("--data-path", None, "dataset prefix(es), or weight prefix pairs to blend",
                                       nargs="*")
    split: str = flag("--split", DEFAULT_SPLIT,
                      "train, valid, test proportions of --data-path (non-negative numbers, not all 0)")
    train_data_path: list[str] | None = flag("--train-data-path", None, "dataset prefix(es) used whole for training",
                                             nargs="*")
    valid_data_path: list[str] | None = flag("--valid-data-path", None,
                                             "dataset prefix(es) used whole for validation", nargs="*")
    test_data_path: list[str] | None = flag("--test-data-path", None, "dataset prefix(es) used whole for testing",
                                            nargs="*")
    data_cache_path: str | None = flag("--data-cache-path", None,
                                       "directory for index caches (default: cache/ beside the data)", type=str)
    eod_mask_loss: bool = flag("--eod-mask-loss", False, "no loss on end-of-document tokens", action="store_true")
    reset_position_ids: bool = flag("--reset-position-ids", False, "positions restart after each end-of-document",
                                    action="store_true")
    reset_attention_mask: bool = flag("--reset-attention-mask", False, "no attention across documents (attended "
                                      "tile by tile from per-token document ids; no [s, s] mask)",
                                      action="store_true")
    num_workers: int = flag("--num-workers", 0, "data loader worker processes (>= 0; 0: none)",
                            check=at_least_0("0: load in the main process"))
    create_attention_mask_in_dataloader: bool = flag(
        "--no-create-attention-mask-in-dataloader", True,
        "the data loader builds no attention mask (causal attention needs none); refused with "
        "--reset-attention-mask, whose document boundaries (per-token document ids, in place of Megatron-LM's "
        "[s, s] mask) the loader builds. Without it megalite builds them only for --reset-attention-mask: a plain "
        "causal mask would equal is_causal", action="store_false")
    mmap_bin_files: bool = flag(
        "--no-mmap-bin-files", True, "read each sample from the .bin files with a positioned read instead of "
        "memory-mapping them (as Megatron-LM; for file systems where mmap is slow)", action="store_false")
    # fill-in-the-middle samples (data/fim.py; Megatron-LM's GPTFIMDataset)
    fim_data: bool = flag("--fim-data", False, "fill-in-the-middle samples: each document, at --fim-rate, cut at "
                          "two random characters into prefix, middle, suffix and reordered with sentinel tokens "
                          "(PSM, or SPM at --fim-spm-rate), the sample's length kept", action="store_true")
    fim_rate: float = flag("--fim-rate", 0.5, "--fim-data: probability of making a document FIM", check=IN_0_1_CLOSED)
    fim_spm_rate: float = flag("--fim-spm-rate", 0.5, "--fim-data: probability of SPM over PSM", check=IN_0_1_CLOSED)
    fim_split_sample: str | None = flag("--fim-split-sample", None, "--fim-data: a token whose fragments are made "
                                        "FIM each (at --fim-fragment-rate)", type=str)
    fim_fragment_rate: float | None = flag("--fim-fragment-rate", None, "--fim-data with --fim-split-sample: "
                                           "probability per fragment", type=float, check=IN_0_1_CLOSED)
    fim_no_prefix: str | None = flag("--fim-no-prefix", None, "--fim-data: documents whose text starts with this are "
                                     "left as they are", type=str)
    fim_prefix_token: str = flag("--fim-prefix-token", "<fim_prefix>", "--fim-data: the prefix sentinel")
    fim_middle_token: str = flag("--fim-middle-token", "<fim_middle>", "--fim-data: the middle sentinel")
    fim_suffix_token: str = flag("--fim-suffix-token", "<fim_suffix>", "--fim-data: the suffix sentinel")
    fim_pad_token: str = flag("--fim-pad-token", "<fim_pad>", "--fim-data: what pads a sample that got shorter")
    fim_eod_token: str = flag("--fim-eod-token", "<|endoftext|>", "--fim-data: the end-of-document token documents "
                              "are split at")
    seq_length: int = derived(1024, copy_of="model.seq_length")
    seed: int = derived(1234, copy_of="training.seed")
    micro_batch_size: int = derived(1, copy_of="training.micro_batch_size")
    vocab_size: int | None = derived(None, copy_of="tokenizer.vocab_size")


@dataclass
class TokenizerConfig:
    """tokenizer"""
    tokenizer_type: str | None = flag("--tokenizer-type", None, TOKENIZER_TYPES_HELP, choices=TOKENIZER_TYPES)
    vocab_file: str | None = flag("--vocab-file", None, "GPT2BPETokenizer: vocab.json", type=str)
    merge_file: str | None = flag("--merge-file", None, "GPT2BPETokenizer: merges.txt", type=str)
    tokenizer_model: str | None = flag(
        "--tokenizer-model", None, "SentencePieceTokenizer / GPTSentencePieceTokenizer: the .model file; "
        "HuggingFaceTokenizer: a local tokenizer directory", type=str)
    vocab_size: int | None = flag(
        "--vocab-size", None, "(>= 1) the model's vocabulary for --mock-data without a tokenizer; the tokenizer's "
        "argument for NullTokenizer (ids 0..N-1 plus an end-of-document id N: the model gets N+1, as in "
        "Megatron-LM); with another tokenizer, optional, at least the tokenizer's vocabulary", type=int,
        check=AT_LEAST_1)
    tiktoken_pattern: str | None = flag("--tiktoken-pattern", None, "TikTokenizer (required there): the "
                                        "pre-tokenisation regex, Megatron-LM's v1 or v2", choices=["v1", "v2"])
    tiktoken_num_special_tokens: int = flag("--tiktoken-num-special-tokens", 1000, "TikTokenizer: ids 0..N-1 are "
                                            "special tokens, the vocabulary file's ranks follow", check=AT_LEAST_1)
    tiktoken_special_tokens: list[str] | None = flag(
        "--tiktoken-special-tokens", None, "TikTokenizer: the first special tokens (must include <unk> <s> </s>; "
        "default those three; </s> is the end-of-document)", nargs="+")


__all__ = ["DEFAULT_SPLIT", "DataConfig", "TokenizerConfig"]
