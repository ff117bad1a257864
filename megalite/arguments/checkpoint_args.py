"""--use-checkpoint-args (Megatron-LM's load_args_from_checkpoint): the model's architecture and
tokenizer flags from the latest checkpoint under --load. Validation applies it before any other
check, so the flags it supplies may be left off the command line (--num-layers and the other
required shape flags included). It reads metadata.json only (checkpoint/files.py
`checked_metadata`), never a tensor, and a missing --load or an unreadable checkpoint is one
ArgumentError naming the flag and the file.

Megatron-LM can also take the TP/PP sizes from the checkpoint (its checkpoints are cut by the
layout they were saved on); megalite's reshard on load across any TP/PP/DP layout, so the
parallel layout always stays the command line's."""
from __future__ import annotations

import os

from ..config.fields import flagged_fields
from ..config.run import IF_NOT_GIVEN, SECTIONS, RunConfig, from_saved
from ..errors import CheckpointError
from .errors import fail

# The shape flags, taken only where the command line does not give them, are config/run.py's
# IF_NOT_GIVEN (the load's mismatch message names them too).
# Forced, the checkpoint winning over the command line (Megatron-LM's force=True): flags a launch
# script repeats by habit (and whose default Megatron-LM cannot tell from "not given"), while the
# weights only make sense with the checkpoint's values: how attention, the MLP, the norms and the
# positions compute (a SwiGLU checkpoint does not load as a GeLU model), and the dropouts, so that
# a continued run trains as the checkpoint did.
FORCED = (
    "model.num_query_groups", "model.group_query_attention", "model.position_embedding_type", "model.rotary_base",
    "model.rotary_percent", "model.add_bias_linear", "model.add_qkv_bias", "model.swiglu",
    "model.untie_embeddings_and_output_weights",
    "model.apply_layernorm_1p", "model.normalization", "model.attention_dropout", "model.hidden_dropout",
    # Megatron-LM's padded_vocab_size: megalite pads --vocab-size (or the tokenizer's vocabulary) to a
    # multiple of --make-vocab-size-divisible-by x TP, so these two give the checkpoint's rows on its
    # TP size (on another, the load trims or zero-fills the padding rows)
    "tokenizer.vocab_size", "model.make_vocab_size_divisible_by",
    "tokenizer.tiktoken_pattern",
    # megalite's architecture flags beyond Megatron-LM's list: the load compares each with the
    # checkpoint (checkpoint/native/state.py MODEL_FLAGS, ROPE_FLAGS), so only the checkpoint's value loads
    "model.norm_epsilon", "model.openai_gelu", "model.use_rope_scaling", "model.rope_scaling_factor",
    "model.rope_scaling_low_freq_factor", "model.rope_scaling_high_freq_factor",
    "model.rope_scaling_original_max_position_embeddings", "model.rotary_seq_len_interpolation_factor",
    "model.rotary_scaling_factor", "model.yarn_original_max_position_embeddings", "model.yarn_beta_fast",
    "model.yarn_beta_slow", "model.mscale", "model.mscale_all_dim", "model.yarn_correction_range_round_to_int",
    # Mixture of Experts: which layers have experts, how many, their size and how tokens are routed
    # (the load compares the shapes: checkpoint/native/state.py check_moe_config)
    "model.num_experts", "model.moe_ffn_hidden_size", "model.moe_router_topk", "model.moe_layer_freq",
    "model.moe_router_score_function", "model.moe_router_pre_softmax", "model.moe_router_enable_expert_bias",
    "model.moe_shared_expert_intermediate_size", "model.moe_shared_expert_gate", "model.moe_router_num_groups",
    "model.moe_router_group_topk", "model.moe_router_topk_scaling_factor", "model.moe_router_dtype",
    # attention variants: extra weights (q/k norms, sinks) or another function of the same weights
    "model.qk_layernorm", "model.window_size", "model.window_attn_skip_freq", "model.softmax_type",
    # gpt-oss's MLP: another function of the same fc1 / fc2 weights (and Nemotron's squared ReLU)
    "model.quick_geglu", "model.glu_linear_offset", "model.activation_func_clamp_value", "model.squared_relu",
    "model.rotary_interleaved",
    # multi-latent attention: its weights' shapes and its RoPE
    "model.multi_latent_attention", "model.q_lora_rank", "model.kv_lora_rank", "model.qk_head_dim",
    "model.qk_pos_emb_head_dim", "model.v_head_dim", "model.rope_type",
    # multi-token prediction: the MTP modules' weights
    "model.mtp_num_layers",
)
# The tokenizer file and its type: forced by default (Megatron-LM's
# use_tokenizer_model_from_checkpoint_args). --no-use-tokenizer-model-from-checkpoint-args keeps
# the command line's file (the checkpoint's path may not exist on this machine) and its type,
# taking the checkpoint's type only where the command line names none.
TOKENIZER = ("tokenizer.tokenizer_type", "tokenizer.tokenizer_model")


def _flags() -> dict:
    return {f"{s}.{f.name}": fl for s, cls in SECTIONS.items() for f, fl in flagged_fields(cls)}


def _get(c: RunConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(c, section), name)


def _shown(flags: dict, key: str, value) -> str:
    """A field's value as the command line would give it ("--swiglu", "--num-layers 2")."""
    fl = flags[key]
    if fl.action in ("store_true", "store_false"):
        return fl.name if value == (fl.action == "store_true") else f"no {fl.name}"
    return f"no {fl.name}" if value is None else f"{fl.name} {value}"


def _read_saved(load: str):
    """(metadata, {section: {field: value}}) of the latest checkpoint under `load`; None when
    there is none yet (no directory, or no latest-iteration file in it)."""
    from ..checkpoint.files import checked_metadata
    from ..checkpoint.paths import TRACKER
    if not os.path.isfile(os.path.join(load, TRACKER)):
        return None
    try:
        meta = checked_metadata(load, "--load")
    except CheckpointError as e:
        fail(f"--use-checkpoint-args: {e}")
    return meta, from_saved(meta)


def apply_checkpoint_args(c: RunConfig) -> None:
    """Set `c`'s architecture and tokenizer fields from the checkpoint under --load (in place),
    mark them given (`c.explicit`), and say in a notice what changed."""
    ck = c.checkpoint
    if not ck.use_checkpoint_args:
        if not ck.use_tokenizer_model_from_checkpoint_args:
            c.notices.append("--no-use-tokenizer-model-from-checkpoint-args has no effect without "
                             "--use-checkpoint-args (Megatron-LM accepts and ignores it there)")
        return
    if not ck.load:
        fail("--use-checkpoint-args needs --load (the checkpoint to take the model's arguments from)")
    flags = _flags()
    saved = _read_saved(ck.load)
    if saved is None:  # as Megatron-LM: the command line's flags, so one script serves the first run and the resume
        for key in IF_NOT_GIVEN:
            if flags[key].required and key not in c.explicit:
                fail(f"{flags[key].name} is required: --use-checkpoint-args found no checkpoint under --load "
                     f"{ck.load} to take it from")
        c.notices.append(f"--use-checkpoint-args: no checkpoint under --load {ck.load} yet; the command line's "
                         f"model arguments are used (as Megatron-LM)")
        return
    meta, sections = saved
    before, given = {key: _get(c, key) for key in IF_NOT_GIVEN + FORCED + TOKENIZER}, c.explicit
    _take(c, sections)
    changed = [key for key in before if _get(c, key) != before[key]]
    if not changed:
        c.notices.append(f"--use-checkpoint-args: {meta['dir']} has the command line's architecture and tokenizer")
        return
    over = [_shown(flags, key, before[key]) for key in changed if key in given]
    c.notices.append(f"--use-checkpoint-args took from {meta['dir']}: "
                     + ", ".join(_shown(flags, key, _get(c, key)) for key in changed)
                     + (f" (over the command line's {', '.join(over)})" if over else ""))


def _unused_default(name: str, model: dict) -> bool:
    """A setting the checkpoint's model does not use, so not "given" (validation refuses a given one
    without its feature): a dense checkpoint's MoE defaults, a non-YaRN checkpoint's YaRN ones."""
    from .model import YARN_FLAGS
    if name.startswith("moe_"):
        return not model.get("num_experts")
    mla = name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type")
    if mla:
        return not model.get("multi_latent_attention")
    mla_yarn = model.get("multi_latent_attention") and (model.get("rope_type") or "yarn") == "yarn"
    return name in YARN_FLAGS and model.get("position_embedding_type") != "yarn" and not mla_yarn


def _take(c: RunConfig, sections: dict) -> None:
    """The field-by-field copy; a value the checkpoint does not record (an older checkpoint) or
    records as unset is skipped, as Megatron-LM skips a checkpoint argument that is None."""
    use_tokenizer = c.checkpoint.use_tokenizer_model_from_checkpoint_args
    forced = FORCED + (TOKENIZER if use_tokenizer else ())
    if_not_given = IF_NOT_GIVEN + (() if use_tokenizer else ("tokenizer.tokenizer_type",))
    explicit = set(c.explicit)
    for key in if_not_given + forced:
        section, name = key.split(".")
        value = sections.get(section, {}).get(name)
        if value is None or (key in if_not_given and key in c.explicit):
            continue
        setattr(getattr(c, section), name, value)
        if not _unused_default(name, sections.get("model", {})):
            explicit.add(key)
    if sections.get("model", {}).get("group_query_attention") is False:
        # multi-head attention: the saved count is validation's fill-in (a group per head), not a
        # flag, and a --num-query-groups on the command line belonged to the grouped-query
        # attention the checkpoint switched off
        c.model.num_query_groups = None
        explicit.discard("model.num_query_groups")
    c.explicit = frozenset(explicit)
