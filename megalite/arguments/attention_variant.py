"""--experimental-attention-variant's flags (config/attention_variant.py): what each variant needs
and what it cannot be combined with (yet), one `error:` line each."""
from __future__ import annotations

from dataclasses import fields

from ..config.attention_variant import linear_attention_pattern
from ..config.model import GPTConfig
from ..config.run import RunConfig
from .errors import fail

LINEAR_FLAGS = {"linear_attention_freq": "--linear-attention-freq", "linear_conv_kernel_dim": "--linear-conv-kernel-dim",
                "linear_key_head_dim": "--linear-key-head-dim", "linear_value_head_dim": "--linear-value-head-dim",
                "linear_num_key_heads": "--linear-num-key-heads", "linear_num_value_heads": "--linear-num-value-heads"}
DSA_FLAGS = {"dsa_indexer_n_heads": "--dsa-indexer-n-heads", "dsa_indexer_head_dim": "--dsa-indexer-head-dim",
             "dsa_indexer_topk": "--dsa-indexer-topk", "dsa_indexer_loss_coeff": "--dsa-indexer-loss-coeff",
             "dsa_indexer_use_sparse_loss": "--dsa-indexer-use-sparse-loss"}

_DEFAULTS = {f.name: f.default for f in fields(GPTConfig)}


def check_attention_variant(c: RunConfig) -> None:
    """A variant's flags without the variant; gated DeltaNet's and DSA's shapes and what they refuse."""
    m = c.model
    if m.attention_output_gate and m.multi_latent_attention:
        fail("--attention-output-gate with --multi-latent-attention: megalite gates softmax attention's output "
             "(Qwen3-Next's gated attention), not MLA's")
    variant = m.experimental_attention_variant
    for table, wanted in ((LINEAR_FLAGS, ("gated_delta_net", "gdn")), (DSA_FLAGS, ("dsa",))):
        # (--use-checkpoint-args makes the checkpoint's values explicit: its defaults are no request)
        given = [f for key, f in table.items() if f"model.{key}" in c.explicit and getattr(m, key) != _DEFAULTS[key]]
        if given and variant not in wanted:
            fail(f"{given[0]} shapes --experimental-attention-variant {wanted[0]}, which is not set")
    if variant is None:
        return
    if c.optimizer.optimizer == "muon":
        fail(f"--optimizer muon with --experimental-attention-variant {variant}: not tested with the DeltaNet's "
             "in_proj (rows by key head) or DSA's indexer; use adam")
    if c.data.reset_attention_mask and variant == "dsa":
        fail("--reset-attention-mask with --experimental-attention-variant dsa: its indexer and sparse attention "
             "do not stop at document boundaries (the result would differ from the mask's)")
    if variant == "dsa":
        _check_dsa(c)
    else:
        _check_gated_delta_net(c)


def _check_gated_delta_net(c: RunConfig) -> None:
    m, tp = c.model, c.parallel.tensor_model_parallel_size
    if m.linear_attention_freq is None:
        fail("--experimental-attention-variant gated_delta_net needs --linear-attention-freq (N: N-1 DeltaNet "
             "layers then one softmax layer; or a list of 1/0 per layer)")
    try:
        linear_attention_pattern(m.linear_attention_freq, m.num_layers)
    except ValueError as e:
        fail(f"--linear-attention-freq {m.linear_attention_freq}: {e}")
    nk, nv = m.linear_num_key_heads, m.linear_num_value_heads
    if nv % nk:
        fail(f"--linear-num-value-heads ({nv}) is not a multiple of --linear-num-key-heads ({nk})")
    if nk % tp:
        fail(f"--linear-num-key-heads ({nk}) is not divisible by --tensor-model-parallel-size ({tp}): the DeltaNet "
             "layers split their key heads (each with its value heads) across TP")
    cp = c.parallel.context_parallel_size
    if (nk // tp) % cp:
        fail(f"--linear-num-key-heads ({nk}) / --tensor-model-parallel-size ({tp}) = {nk // tp} key heads per rank "
             f"cannot split over --context-parallel-size {cp}: under CP each rank runs the whole sequence of 1/{cp} "
             "of them (the delta rule's state runs through the sequence in order)")
    if cp > 1:
        c.notices.append(f"--cp-comm-type applies to the softmax layers: under --context-parallel-size {cp} the gated "
                         "DeltaNet layers always exchange heads by all-to-all (Megatron-LM's cp2hp / hp2cp)")
    if m.multi_latent_attention:
        fail("--experimental-attention-variant gated_delta_net with --multi-latent-attention: the softmax layers "
             "between DeltaNet layers are megalite's (gated) softmax attention, not MLA")


def _check_dsa(c: RunConfig) -> None:
    m = c.model
    if not m.multi_latent_attention or m.q_lora_rank is None:
        fail("--experimental-attention-variant dsa needs --multi-latent-attention with --q-lora-rank (the "
             "indexer reads the query latent, as DeepSeek-V3.2)")
    missing = [f for key, f in DSA_FLAGS.items() if key not in ("dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss")
               and getattr(m, key) is None]
    if missing:
        fail(f"--experimental-attention-variant dsa needs {missing[0]}")
    if m.dsa_indexer_head_dim < m.qk_pos_emb_head_dim:
        fail(f"--dsa-indexer-head-dim ({m.dsa_indexer_head_dim}) is below --qk-pos-emb-head-dim "
             f"({m.qk_pos_emb_head_dim}): the indexer rotates its first --qk-pos-emb-head-dim channels")
