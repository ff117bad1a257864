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
from megalite.arguments.checkpoint_args import FORCED
from megalite.config.run import IF_NOT_GIVEN
from tiny import mock, tiny

# a model unlike every default: a run that ignored the checkpoint could not come out equal
ARCH = ["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "32",
        "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "500000",
        "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--apply-layernorm-1p", "--hidden-dropout", "0.0",
        "--attention-dropout", "0.05", "--make-vocab-size-divisible-by", "64",
        "--qk-layernorm", "--window-size", "8,0", "--window-attn-skip-freq", "3", "--softmax-type", "learnable"]
RUN = ["--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0"]


def config(argv):
    return parse_config(argv, world_size=1, check_files=False)


def write_checkpoint(root, argv, iteration=3) -> dict:
    """A checkpoint's metadata.json (no tensors: --use-checkpoint-args reads nothing else) for
    the validated flags `argv`; returns its config sections."""
    sections = config(argv).to_dict()
    directory = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(directory)
    # the model as a run records it: the vocabulary filled from the tokenizer's
    model = dict(sections["model"], vocab_size=sections["tokenizer"]["vocab_size"] or sections["model"]["vocab_size"])
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"format_version": 2, "iteration": iteration, "layout": {}, "config_version": 2,
                   "config": sections, "model_config": model}, f)
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


# -- a checkpoint of another model: every differing flag named, each value the right way round ----
DENSE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16,
             ffn_hidden_size=256, vocab_size=1000, seq_length=32, max_position_embeddings=32)
ROPE_MODEL = dict(DENSE, position_embedding_type="rope", use_rope_scaling=True)
YARN_MODEL = dict(DENSE, position_embedding_type="yarn", rotary_scaling_factor=4.0,
                  yarn_original_max_position_embeddings=16)
MOE_MODEL = dict(DENSE, num_experts=4, moe_ffn_hidden_size=32)
MLA_MODEL = dict(DENSE, position_embedding_type="rope", multi_latent_attention=True, rope_type="rope")
# (the model saved, field, this run's value, flag, as the flag gives the checkpoint's value, this run's)
MISMATCHES = [
    (DENSE, "num_layers", 6, "--num-layers", 4, 6),
    (DENSE, "hidden_size", 128, "--hidden-size", 64, 128),
    (DENSE, "num_attention_heads", 8, "--num-attention-heads", 4, 8),
    (DENSE, "num_query_groups", 2, "--num-query-groups", 4, 2),
    (DENSE, "kv_channels", 32, "--kv-channels", 16, 32),
    (DENSE, "ffn_hidden_size", 128, "--ffn-hidden-size", 256, 128),
    (DENSE, "vocab_size", 1024, "--vocab-size (the tokenizer's vocabulary)", 1000, 1024),
    (DENSE, "position_embedding_type", "rope", "--position-embedding-type", "learned_absolute", "rope"),
    (DENSE, "normalization", "RMSNorm", "--normalization", "LayerNorm", "RMSNorm"),
    (DENSE, "swiglu", True, "--swiglu", False, True),
    (DENSE, "add_bias_linear", False, "--disable-bias-linear", False, True),  # the flag negates the field
    (dict(DENSE, add_bias_linear=False), "add_bias_linear", True, "--disable-bias-linear", True, False),
    (DENSE, "add_qkv_bias", True, "--add-qkv-bias", False, True),
    (DENSE, "untie_embeddings_and_output_weights", True, "--untie-embeddings-and-output-weights", False, True),
    (DENSE, "rotary_percent", 0.5, "--rotary-percent", 1.0, 0.5),
    (DENSE, "norm_epsilon", 1e-6, "--norm-epsilon", 1e-5, 1e-6),
    (DENSE, "openai_gelu", True, "--openai-gelu", False, True),
    (DENSE, "apply_layernorm_1p", True, "--apply-layernorm-1p", False, True),
    (DENSE, "qk_layernorm", True, "--qk-layernorm", False, True),
    (DENSE, "window_size", "128,0", "--window-size", None, "128,0"),
    (dict(DENSE, window_size="8,0"), "window_attn_skip_freq", "2", "--window-attn-skip-freq", None, "2"),
    (DENSE, "softmax_type", "learnable", "--softmax-type", "vanilla", "learnable"),
    (DENSE, "quick_geglu", True, "--quick-geglu", False, True),
    (dict(DENSE, quick_geglu=True), "glu_linear_offset", 1.0, "--glu-linear-offset", 0.0, 1.0),
    (dict(DENSE, quick_geglu=True), "activation_func_clamp_value", 7.0, "--activation-func-clamp-value", None, 7.0),
    (DENSE, "mtp_num_layers", 1, "--mtp-num-layers", None, 1),
    (DENSE, "squared_relu", True, "--squared-relu", False, True),
    (dict(DENSE, position_embedding_type="rope"), "rotary_interleaved", True, "--rotary-interleaved", False, True),
    (DENSE, "max_position_embeddings", 64, "--max-position-embeddings", 32, 64),
    (ROPE_MODEL, "rotary_base", 500000.0, "--rotary-base", 10000.0, 500000.0),
    (ROPE_MODEL, "use_rope_scaling", False, "--use-rope-scaling", True, False),
    (ROPE_MODEL, "rope_scaling_factor", 32.0, "--rope-scaling-factor", 8.0, 32.0),
    (ROPE_MODEL, "rope_scaling_low_freq_factor", 2.0, "--rope-scaling-low-freq-factor", 1.0, 2.0),
    (ROPE_MODEL, "rope_scaling_high_freq_factor", 8.0, "--rope-scaling-high-freq-factor", 4.0, 8.0),
    (ROPE_MODEL, "rope_scaling_original_max_position_embeddings", 4096,
     "--rope-scaling-original-max-position-embeddings", 8192, 4096),
    (ROPE_MODEL, "rotary_seq_len_interpolation_factor", 2.0, "--rotary-seq-len-interpolation-factor", None, 2.0),
    (YARN_MODEL, "position_embedding_type", "rope", "--position-embedding-type", "yarn", "rope"),
    (YARN_MODEL, "rotary_scaling_factor", 8.0, "--rotary-scaling-factor", 4.0, 8.0),
    (YARN_MODEL, "yarn_original_max_position_embeddings", 32, "--yarn-original-max-position-embeddings", 16, 32),
    (YARN_MODEL, "yarn_beta_fast", 16.0, "--yarn-beta-fast", 32.0, 16.0),
    (YARN_MODEL, "yarn_beta_slow", 2.0, "--yarn-beta-slow", 1.0, 2.0),
    (YARN_MODEL, "mscale", 0.707, "--mscale", 1.0, 0.707),
    (YARN_MODEL, "mscale_all_dim", 0.707, "--mscale-all-dim", 0.0, 0.707),
    (YARN_MODEL, "yarn_correction_range_round_to_int", False, "--yarn-correction-range-round-to-int", True, False),
    (DENSE, "num_experts", 4, "--num-experts", None, 4),
    (MOE_MODEL, "num_experts", 8, "--num-experts", 4, 8),
    (MOE_MODEL, "moe_ffn_hidden_size", 64, "--moe-ffn-hidden-size", 32, 64),
    (MOE_MODEL, "moe_router_topk", 1, "--moe-router-topk", 2, 1),
    (MOE_MODEL, "moe_layer_freq", "2", "--moe-layer-freq", [True] * 4, [True, False] * 2),
    (MOE_MODEL, "moe_router_score_function", "sigmoid", "--moe-router-score-function", "softmax", "sigmoid"),
    (MOE_MODEL, "moe_router_pre_softmax", True, "--moe-router-pre-softmax", False, True),
    (MOE_MODEL, "moe_router_enable_expert_bias", True, "--moe-router-enable-expert-bias", False, True),
    (MOE_MODEL, "moe_shared_expert_intermediate_size", 16, "--moe-shared-expert-intermediate-size", None, 16),
    (MOE_MODEL, "moe_shared_expert_gate", True, "--moe-shared-expert-gate", False, True),
    (MOE_MODEL, "moe_router_num_groups", 2, "--moe-router-num-groups", None, 2),
    (MOE_MODEL, "moe_router_group_topk", 1, "--moe-router-group-topk", None, 1),
    (MOE_MODEL, "moe_router_topk_scaling_factor", 2.5, "--moe-router-topk-scaling-factor", 1.0, 2.5),
    (MOE_MODEL, "moe_router_dtype", "fp64", "--moe-router-dtype", "fp32", "fp64"),
    (dict(DENSE, position_embedding_type="rope"), "multi_latent_attention", True, "--multi-latent-attention", False,
     True),
    (MLA_MODEL, "q_lora_rank", 24, "--q-lora-rank", None, 24),
    (MLA_MODEL, "kv_lora_rank", 16, "--kv-lora-rank", 32, 16),
    (MLA_MODEL, "qk_head_dim", 16, "--qk-head-dim", 128, 16),
    (MLA_MODEL, "qk_pos_emb_head_dim", 8, "--qk-pos-emb-head-dim", 64, 8),
    (MLA_MODEL, "v_head_dim", 16, "--v-head-dim", 128, 16),
    (MLA_MODEL, "rope_type", None, "--rope-type", "rope", "yarn"),  # none: MLA's yarn
]


def gpt_config(fields: dict) -> dict:
    from megalite.model import GPTConfig
    return GPTConfig(**fields).to_dict()


@pytest.mark.parametrize("model,key,new,flag,old_shown,new_shown", MISMATCHES,
                         ids=[f"{m[1]}{'-' + str(m[2]) if m[1] == 'add_bias_linear' else ''}" for m in MISMATCHES])
def test_mismatch_names_the_flag_with_both_values(model, key, new, flag, old_shown, new_shown):
    from megalite.checkpoint.native.state import check_model_config
    from megalite.errors import CheckpointError
    saved = gpt_config(model)
    check_model_config(saved, dict(saved), "ck")
    with pytest.raises(CheckpointError) as e:
        check_model_config(saved, dict(saved, **{key: new}), "ck")
    message = str(e.value)
    assert f"{flag} is {old_shown!r} in the checkpoint and {new_shown!r} in this run" in message, message
    assert "--use-checkpoint-args takes these from the checkpoint" in message
    # the one flag that differs, and no other
    assert message.count(" in the checkpoint and ") == 1, message


def test_every_compared_setting_has_a_case_and_is_taken_by_checkpoint_args():
    """The mismatch message's advice holds for every flag the load compares."""
    from megalite.checkpoint.native.state import MLA_FLAGS, MODEL_FLAGS, MOE_FLAGS, ROPE_FLAGS, YARN_FLAGS
    compared = (set(MODEL_FLAGS) | set(ROPE_FLAGS) | set(MOE_FLAGS) | set(YARN_FLAGS) | set(MLA_FLAGS)
                | {"rotary_base", "max_position_embeddings"})
    assert compared <= {m[1] for m in MISMATCHES}
    taken = {k.split(".")[1] for k in IF_NOT_GIVEN + FORCED}
    assert compared <= taken, compared - taken


def test_mismatch_names_every_differing_flag():
    """4 -> 6 layers, a new hidden size and biases off: all three, in one message."""
    from megalite.checkpoint.native.state import check_model_config
    from megalite.errors import CheckpointError
    saved = gpt_config(DENSE)
    with pytest.raises(CheckpointError) as e:
        check_model_config(saved, dict(saved, num_layers=6, hidden_size=128, add_bias_linear=False), "ck")
    assert str(e.value) == (
        "checkpoint ck does not match this model: --num-layers is 4 in the checkpoint and 6 in this run; "
        "--hidden-size is 64 in the checkpoint and 128 in this run; --disable-bias-linear is False in the checkpoint "
        "and True in this run. --use-checkpoint-args takes these from the checkpoint (--num-layers, --hidden-size "
        "only where the command line leaves them off)")


# -- a resume's learning-rate schedule against the checkpoint's ------------------------------------
SCHED = mock(100) + tiny(train_iters=30, lr_warmup_iters=2, min_lr=1e-4)
WSD = ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10"]
DECAY = "the decay length (--train-iters, with no --lr-decay-iters)"
# (the checkpoint's flags beyond SCHED, this run's beyond SCHED, what the refusal says)
SCHEDULE_CHANGES = [
    ([], ["--lr", "2e-3"], "--lr is 0.001 in the checkpoint and 0.002 in this run"),
    ([], ["--min-lr", "0"], "--min-lr is 0.0001 in the checkpoint and 0.0 in this run"),
    ([], ["--train-iters", "40"], f"{DECAY} is 30 iterations in the checkpoint and 40 iterations in this run"),
    ([], ["--lr-decay-iters", "20"], "the decay length (--lr-decay-iters) is 30 iterations in the checkpoint and 20 "
                                     "iterations in this run"),
    ([], ["--lr-warmup-iters", "3"], "the warmup (--lr-warmup-iters) is 2 iterations in the checkpoint and 3 "
                                     "iterations in this run"),
    ([], ["--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.1"],
     "the warmup (--lr-warmup-fraction 0.1 of the decay) is 2 iterations in the checkpoint and 3 iterations in this run"),
    ([], ["--lr-warmup-init", "1e-5"], "--lr-warmup-init is 0.0 in the checkpoint and 1e-05 in this run"),
    ([], ["--lr-decay-style", "cosine"], "--lr-decay-style is linear in the checkpoint and cosine in this run"),
    (WSD, ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5"],
     "the WSD decay phase (--lr-wsd-decay-iters) is 10 iterations in the checkpoint and 5 iterations in this run"),
    (WSD, WSD + ["--lr-wsd-decay-style", "linear"],
     "--lr-wsd-decay-style is exponential in the checkpoint and linear in this run"),
    ([], ["--decoupled-lr", "5e-3"], "--decoupled-lr is none in the checkpoint and 0.005 in this run"),
    (["--decoupled-lr", "5e-3"], ["--decoupled-lr", "5e-3", "--decoupled-min-lr", "1e-3"],
     "--decoupled-min-lr is none in the checkpoint and 0.001 in this run"),
    ([], ["--weight-decay", "0.1"], "--weight-decay is 0.01 in the checkpoint and 0.1 in this run"),
    ([], ["--global-batch-size", "4"], "the warmup (--lr-warmup-iters) is 2 iterations of 8 samples in the checkpoint "
                                       f"and 2 iterations of 4 samples in this run; {DECAY} is 30 iterations of 8 "
                                       "samples in the checkpoint and 30 iterations of 4 samples in this run"),
    (["--train-iters", None, "--train-samples", "240", "--lr-warmup-iters", "0", "--lr-warmup-samples", "16"],
     ["--train-iters", None, "--train-samples", "240", "--lr-warmup-iters", "0", "--lr-warmup-samples", "16",
      "--lr-decay-samples", "200"],
     "the decay length (--lr-decay-samples) is 240 samples in the checkpoint and 200 samples in this run"),
]


def with_flags(base: list, extra: list) -> list:
    """`base` with `extra`'s flags replacing its own (a value None drops the flag)."""
    out, i = list(base), 0
    while i < len(extra):
        name = extra[i]
        takes_value = i + 1 < len(extra) and (extra[i + 1] is None or not extra[i + 1].startswith("--"))
        if name in out:
            j = out.index(name)
            del out[j:j + (2 if j + 1 < len(out) and not out[j + 1].startswith("--") else 1)]
        if not takes_value or extra[i + 1] is not None:
            out += extra[i:i + 1 + takes_value]
        i += 1 + takes_value
    return out


def settled(ck: str, argv: list):
    """The validated config of a resume from `ck` once its schedule is settled against the
    checkpoint's (what validation does after its file checks)."""
    from megalite.arguments.schedule_args import settle_schedule
    c = config(argv + ["--load", ck])
    settle_schedule(c)
    return c


@pytest.mark.parametrize("saved,run,message", SCHEDULE_CHANGES, ids=[" ".join(map(str, r)) for _, r, _ in SCHEDULE_CHANGES])
def test_another_schedule_is_refused_naming_both_values(tmp_path, saved, run, message):
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, with_flags(SCHED, saved))
    settled(ck, with_flags(SCHED, saved))  # the same schedule resumes
    with pytest.raises(ArgumentError) as e:
        settled(ck, with_flags(SCHED, run))
    text = str(e.value)
    assert message in text, text
    assert text.count(" in the checkpoint and ") == message.count(" in the checkpoint and "), text  # no other
    assert "--use-checkpoint-opt_param-scheduler" in text and "--override-opt_param-scheduler" in text


def test_model_and_schedule_differences_in_one_message_model_first(tmp_path):
    """Another model (hidden size, layers, experts) and a longer run: one refusal names both, the
    model's differences (which no schedule flag fixes) first, then the schedule's with its flags."""
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, SCHED)
    run = with_flags(SCHED, ["--train-iters", "40", "--hidden-size", "128", "--num-layers", "3",
                             "--num-experts", "4"])
    with pytest.raises(ArgumentError) as e:
        settled(ck, run)
    text = str(e.value)
    model = text.index("does not match this model: --num-layers is 2 in the checkpoint and 3 in this run; "
                       "--hidden-size is 64 in the checkpoint and 128 in this run; ")
    assert text.index("--num-experts is None in the checkpoint and 4 in this run. --use-checkpoint-args") > model
    schedule = text.index(f"The learning-rate schedule differs too: {DECAY} is 30 iterations in the checkpoint "
                          "and 40 iterations in this run")
    assert model < schedule < text.index("--use-checkpoint-opt_param-scheduler") < text.index("--override-opt_param")
    assert "\n" not in text
    # the model alone: the load refuses it (the schedule is not the message)
    settled(ck, with_flags(SCHED, ["--hidden-size", "128"]))


def test_schedule_flags_override_or_take_the_checkpoints(tmp_path):
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, SCHED + ["--decoupled-lr", "5e-3"])
    longer = with_flags(SCHED, ["--train-iters", "40", "--lr", "2e-3", "--weight-decay", "0.1"])
    ours = settled(ck, longer + ["--override-opt_param-scheduler"]).optimizer
    assert (ours.lr, ours.lr_decay_samples, ours.weight_decay, ours.decoupled_lr) == (2e-3, 320, 0.1, None)
    c = settled(ck, longer + ["--use-checkpoint-opt_param-scheduler"])
    theirs = c.optimizer
    assert (theirs.lr, theirs.lr_decay_samples, theirs.weight_decay, theirs.decoupled_lr) == (1e-3, 240, 0.01, 5e-3)
    assert c.training.train_iters == 40  # the command line still says when to stop
    assert any(n.startswith("--use-checkpoint-opt_param-scheduler: the learning-rate schedule of") and
               "--lr is 0.001 in the checkpoint and 0.002 in this run" in n for n in c.notices), c.notices
    # a constant rate has no decay to stretch: a longer run goes on without either flag
    write_checkpoint(str(tmp_path / "constant"), SCHED + ["--lr-decay-style", "constant"])
    settled(str(tmp_path / "constant"), with_flags(SCHED, ["--train-iters", "40", "--lr-decay-style", "constant"]))


@pytest.mark.parametrize("extra,notice", [(["--no-load-optim"], "--no-load-optim starts a fresh schedule"),
                                          (["--finetune"], "--finetune starts a fresh schedule")])
def test_schedule_is_not_compared_where_the_load_does_not_restore_it(tmp_path, extra, notice):
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, SCHED)
    c = settled(ck, with_flags(SCHED, ["--train-iters", "40"]) + extra + ["--use-checkpoint-opt_param-scheduler"])
    assert c.optimizer.lr_decay_samples == 320
    assert f"--use-checkpoint-opt_param-scheduler has no effect: {notice}" in c.notices[-1]


@pytest.mark.parametrize("argv,message", [
    (["--load", "x", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive"),
    (["--override-opt_param-scheduler"], "--override-opt_param-scheduler needs --load"),
    (["--use-checkpoint-opt_param-scheduler"], "--use-checkpoint-opt_param-scheduler needs --load"),
], ids=["both", "override-without-load", "use-checkpoint-without-load"])
def test_schedule_flags_bad_input(argv, message):
    with pytest.raises(ArgumentError, match=message):
        config(SCHED + argv)
