"""--use-checkpoint-args takes the architecture and tokenizer from the checkpoint under --load
(the shape where the command line leaves it out, the rest over the command line), and
--no-use-tokenizer-model-from-checkpoint-args keeps the command line's tokenizer file. Validated
in one process against metadata.json files written here; one pair of runs checks that the
taken flags build the checkpoint's model and resume it exactly."""
import json
import os

import pytest

from dist_helpers import run_pretrain
from megalite.arguments import ArgumentError, parse_config
from megalite.arguments.checkpoint_args import FORCED, IF_NOT_GIVEN
from tiny import mock, tiny

# a model unlike every default: a run that ignored the checkpoint could not come out equal
ARCH = ["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "32",
        "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "500000",
        "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--apply-layernorm-1p", "--hidden-dropout", "0.0",
        "--attention-dropout", "0.05", "--make-vocab-size-divisible-by", "64"]
RUN = ["--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0"]


def config(argv):
    return parse_config(argv, world_size=1, check_files=False)


def write_checkpoint(root, argv, iteration=3) -> dict:
    """A checkpoint's metadata.json (no tensors: --use-checkpoint-args reads nothing else) for
    the validated flags `argv`; returns its config sections."""
    sections = config(argv).to_dict()
    directory = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(directory)
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"format_version": 2, "iteration": iteration, "layout": {}, "config_version": 2,
                   "config": sections, "model_config": sections["model"]}, f)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return sections


def value(c, key):
    section, name = key.split(".")
    return getattr(getattr(c, section), name)


def test_architecture_comes_from_the_checkpoint(tmp_path):
    ck = str(tmp_path / "ck")
    saved = write_checkpoint(ck, mock(100) + ARCH + RUN)
    # no shape flags; the forced ones contradicted; --seq-length given (the command line keeps it)
    c = config(["--use-checkpoint-args", "--load", ck, "--mock-data", "--vocab-size", "50", "--seq-length", "64",
                "--normalization", "LayerNorm", "--hidden-dropout", "0.3", "--num-query-groups", "4",
                "--group-query-attention"] + RUN)
    for key in IF_NOT_GIVEN + FORCED:
        section, name = key.split(".")
        expected = 64 if key == "model.seq_length" else saved[section][name]
        assert value(c, key) == expected, key
    assert (c.model.num_layers, c.model.ffn_hidden_size, c.model.kv_channels) == (3, 128, 12)
    assert c.tokenizer.vocab_size == 100 and c.data.seq_length == 64
    notice = next(n for n in c.notices if n.startswith("--use-checkpoint-args took from"))
    assert "--num-layers 3" in notice and "--swiglu" in notice, notice
    assert notice.endswith("(over the command line's --num-query-groups 4, --normalization LayerNorm, "
                           "--hidden-dropout 0.3, --vocab-size 50)"), notice
    assert "--seq-length" not in notice, notice
    # the parallel layout stays the command line's (megalite's checkpoints load on any)
    two = parse_config(["--use-checkpoint-args", "--load", ck, "--mock-data", "--tensor-model-parallel-size", "2"]
                       + RUN, world_size=2, check_files=False)
    assert two.parallel.tensor_model_parallel_size == 2 and two.model.hidden_size == 48


def test_multi_head_checkpoint_drops_grouped_query_flags(tmp_path):
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, mock(100) + tiny(train_iters=1))
    c = config(["--use-checkpoint-args", "--load", ck, "--mock-data", "--group-query-attention",
                "--num-query-groups", "2"] + RUN)
    assert not c.model.group_query_attention and c.model.num_query_groups == c.model.num_attention_heads == 4


def test_tokenizer_model_from_the_checkpoint_unless_told_otherwise(tmp_path):
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, ["--mock-data", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                          "/elsewhere/tok.model"] + tiny(train_iters=1))
    base = ["--use-checkpoint-args", "--load", ck, "--mock-data"] + RUN
    default = config(base + ["--tokenizer-model", "here.model"]).tokenizer
    assert (default.tokenizer_type, default.tokenizer_model) == ("SentencePieceTokenizer", "/elsewhere/tok.model")
    own = config(base + ["--no-use-tokenizer-model-from-checkpoint-args", "--tokenizer-model", "here.model"]).tokenizer
    assert (own.tokenizer_type, own.tokenizer_model) == ("SentencePieceTokenizer", "here.model")
    own = config(base + ["--no-use-tokenizer-model-from-checkpoint-args", "--tokenizer-type", "HuggingFaceTokenizer",
                         "--tokenizer-model", "hf_dir"]).tokenizer
    assert (own.tokenizer_type, own.tokenizer_model) == ("HuggingFaceTokenizer", "hf_dir")
    alone = config(mock(100) + tiny(train_iters=1) + ["--no-use-tokenizer-model-from-checkpoint-args"])
    assert any("has no effect without --use-checkpoint-args" in n for n in alone.notices)


@pytest.mark.parametrize("make,extra,message", [
    (None, [], "--use-checkpoint-args needs --load"),
    ("corrupt", ["--load", "CK"], "metadata.json is corrupt"),
    ("empty", ["--load", "CK"], "--num-layers is required: --use-checkpoint-args found no checkpoint under --load"),
], ids=["no-load", "corrupt-metadata", "no-checkpoint-no-shape"])
def test_bad_input(tmp_path, make, extra, message):
    ck = str(tmp_path / "ck")
    if make == "corrupt":
        write_checkpoint(ck, mock(100) + tiny(train_iters=1))
        with open(os.path.join(ck, "iter_0000003", "metadata.json"), "w") as f:
            f.write('{"truncated": ')
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(")):
        config(["--use-checkpoint-args", "--mock-data"] + [ck if a == "CK" else a for a in extra] + RUN)


def test_no_checkpoint_yet_uses_the_command_line(tmp_path):
    """As Megatron-LM: one command line serves the first run and its resumption."""
    c = config(mock(100) + tiny(train_iters=1) + ["--use-checkpoint-args", "--load", str(tmp_path / "none")])
    assert c.model.num_layers == 2 and any("no checkpoint under --load" in n for n in c.notices)


def test_resume_takes_the_checkpoint_model_and_tokenizer(corpus, tmp_path):
    """Saved at 2 and 3 with ARCH on real text; resumed from 2 with --use-checkpoint-args and no
    shape or tokenizer flags (and a contradicting --normalization): the checkpoint's model and
    tokenizer load, and iteration 3 repeats the first run's loss."""
    ck = str(tmp_path / "ck")
    data = corpus[:corpus.index("--tokenizer-type")] + corpus[corpus.index("--tokenizer-model") + 2:]
    train = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-3",
             "--eval-iters", "0", "--log-interval", "1"]
    first, _ = run_pretrain(1, corpus + ARCH + train + ["--save", ck, "--save-interval", "2"], tmp_path, "first")
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")  # resume from iteration 2, so the loss of 3 has a reference
    second, proc = run_pretrain(1, data + train + ["--use-checkpoint-args", "--load", ck, "--normalization",
                                                   "LayerNorm", "--save", str(tmp_path / "ck2")], tmp_path, "second")
    assert "--use-checkpoint-args took from" in proc.stdout + proc.stderr
    losses = lambda records: {r["iteration"]: r["lm_loss"] for r in records if "consumed_samples" in r}  # noqa: E731
    a, b = losses(first), losses(second)
    assert sorted(b) == [3] and all(abs(a[i] - b[i]) <= 1e-6 * abs(a[i]) for i in b), (a, b)
    meta = [json.load(open(os.path.join(d, "iter_0000003", "metadata.json"))) for d in (ck, str(tmp_path / "ck2"))]
    assert meta[1]["model_config"] == meta[0]["model_config"]
    assert meta[1]["config"]["tokenizer"] == meta[0]["config"]["tokenizer"]
