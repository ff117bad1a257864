"""What a checkpoint holds of a run (`TrainState`) and which rank saves, and on load reads,
which pieces of it (`owned_pieces`); how a local shard was cut from the whole tensor; RNG
states; the model settings a checkpoint must share with the run loading it. The layout on disk
is described in the package docstring (checkpoint/__init__.py)."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch

from ... import comm
from ...config.run import shape_flags
from ...errors import CheckpointError
from ...model.init import global_shape, shard
from ...parallel_state import ParallelState
from ...tensor_parallel.param_info import param_info
from .reshard import ShardLayout

STATE_KINDS = ("exp_avg", "exp_avg_sq", "momentum_buffer")

# model settings that must agree between a checkpoint and the run loading it: config key -> flag
MODEL_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "--vocab-size (the tokenizer's vocabulary)", "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization", "swiglu": "--swiglu", "add_bias_linear": "--disable-bias-linear",
    "add_qkv_bias": "--add-qkv-bias",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "rotary_percent": "--rotary-percent", "norm_epsilon": "--norm-epsilon", "openai_gelu": "--openai-gelu",
    "apply_layernorm_1p": "--apply-layernorm-1p", "qk_layernorm": "--qk-layernorm",
    "window_size": "--window-size", "window_attn_skip_freq": "--window-attn-skip-freq",
    "softmax_type": "--softmax-type", "quick_geglu": "--quick-geglu", "glu_linear_offset": "--glu-linear-offset",
    "activation_func_clamp_value": "--activation-func-clamp-value",
    "multi_latent_attention": "--multi-latent-attention",
    "mtp_num_layers": "--mtp-num-layers",  # the MTP modules' weights
    "squared_relu": "--squared-relu", "rotary_interleaved": "--rotary-interleaved",
}
# Mixture of Experts: the weights' shapes (which layers, how many experts, their sizes, the
# shared expert, the expert bias) and the routing
MOE_FLAGS = {key: "--" + key.replace("_", "-") for key in (
    "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor", "moe_router_dtype")}
# multi-latent attention (model/mla.py): its weights' shapes and its RoPE, compared for MLA models
MLA_FLAGS = {key: "--" + key.replace("_", "-") for key in (
    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type")}
# settings whose flag says the opposite of the field (store_false): messages show the flag's value
NEGATED = ("add_bias_linear",)
# RoPE settings, compared for RoPE models only; a key older checkpoints lack means its default
ROPE_FLAGS = {"use_rope_scaling": "--use-rope-scaling", "rope_scaling_factor": "--rope-scaling-factor",
              "rope_scaling_low_freq_factor": "--rope-scaling-low-freq-factor",
              "rope_scaling_high_freq_factor": "--rope-scaling-high-freq-factor",
              "rope_scaling_original_max_position_embeddings": "--rope-scaling-original-max-position-embeddings",
              "rotary_seq_len_interpolation_factor": "--rotary-seq-len-interpolation-factor"}

# YaRN's settings (--position-embedding-type yarn), compared for YaRN models only
YARN_FLAGS = {key: "--" + key.replace("_", "-") for key in (
    "rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow", "mscale",
    "mscale_all_dim", "yarn_correction_range_round_to_int")}


@dataclass
class TrainState:
    """What a checkpoint saves and restores: the model's parameters (global names), the optimizer
    (masters and moments of the pieces it steps), the schedule and loss scaler, RNG states, the
    spike guard's window, and where the run stands. `config` (RunConfig.to_dict()) is recorded in
    metadata.json for the tools."""
    ps: ParallelState
    model_config: object  # model.GPTConfig
    named_params: list
    optimizer: object  # optimizer.MixedPrecisionOptimizer
    scheduler: object  # optimizer.LRScheduler
    rng_tracker: object
    device: torch.device
    config: dict
    iteration: int = 0
    consumed_samples: int = 0
    load_stats: object = None  # LoadStats of the checkpoint load, if any
    # persistent buffers by global name (MoE routers' expert biases): replicated, moved by the
    # trainer rather than the optimizer; saved whole once, read whole by every rank
    named_buffers: list = dataclasses.field(default_factory=list)
    # --check-for-spiky-loss / --check-for-large-grads (runtime/spikes.SpikeGuard), or None: its
    # window is the same on every rank, saved once in the metadata
    spike_guard: object = None

    def log(self, msg: str) -> None:
        if self.ps.rank == self.ps.logging_rank:
            print(msg, flush=True)


def check_model_config(saved: dict, current: dict, where: str) -> None:
    """Raise naming every model setting that differs, each with the checkpoint's value and this
    run's (as the flag gives it), and how --use-checkpoint-args would take them."""
    differences = model_differences(saved, current)
    if differences:
        raise CheckpointError(f"checkpoint {where} does not match this model: "
                              + "; ".join(f"{flag} is {old!r} in the checkpoint and {new!r} in this run"
                                          for flag, old, new in differences)
                              + f". {_checkpoint_args_hint([flag for flag, _, _ in differences])}")


def model_differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(flag, checkpoint's value, this run's value) of each model setting that differs; a key an
    older checkpoint lacks counts as its default."""
    from ...model import GPTConfig
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    positions = current.get("position_embedding_type")
    mla = current.get("multi_latent_attention")
    mla_yarn = mla and (current.get("rope_type") or "yarn") == "yarn"
    flags = dict(MODEL_FLAGS, **(ROPE_FLAGS if positions in ("rope", "yarn") else {}),
                 **(YARN_FLAGS if positions == "yarn" or mla_yarn else {}), **(MLA_FLAGS if mla else {}))
    if not current.get("use_rope_scaling"):  # the scaling parameters matter only when scaling is on
        flags = {k: f for k, f in flags.items() if not k.startswith("rope_scaling_")}
    if positions in ("rope", "yarn"):
        flags["rotary_base"] = "--rotary-base"
    if current.get("position_embedding_type") == "learned_absolute":
        flags["max_position_embeddings"] = "--max-position-embeddings"
    out = []
    for key, flag in flags.items():
        old, new = saved.get(key, defaults.get(key)), current.get(key, defaults.get(key))
        if key == "rope_type":  # MLA's default (none) is yarn, as Megatron-LM's
            old, new = old or "yarn", new or "yarn"
        if old != new:
            out.append((flag, _as_given(key, old), _as_given(key, new)))
    return out + moe_differences(saved, current)


def _as_given(key: str, value):
    """A setting's value as its flag states it: --disable-bias-linear is True where add_bias_linear is False."""
    return (not value) if key in NEGATED and value is not None else value


def _checkpoint_args_hint(flags: list[str]) -> str:
    """How --use-checkpoint-args would take the differing flags (arguments/checkpoint_args.py:
    every flag the load compares is among the ones it takes; the shape only where the command
    line leaves it off, config/run.py's IF_NOT_GIVEN)."""
    kept = [f for f in flags if f in shape_flags()]
    return ("--use-checkpoint-args takes these from the checkpoint"
            + (f" ({', '.join(kept)} only where the command line leaves {'it' if len(kept) == 1 else 'them'} off)"
               if kept else ""))


def check_moe_config(saved: dict, current: dict, where: str) -> None:
    """Raise naming every MoE setting that differs (see `moe_differences`)."""
    differences = moe_differences(saved, current)
    if differences:
        raise CheckpointError(f"checkpoint {where} does not match this model: "
                              + "; ".join(f"{flag} is {old!r} in the checkpoint and {new!r} in this run"
                                          for flag, old, new in differences))


def moe_differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """The MoE settings, the weights' shapes as the layers they give, and the routing (checkpoints
    from before MoE lack them: a dense model; from before a setting, its default). Between a dense
    model and an MoE one only --num-experts differs: the other flags mean nothing to the dense one."""
    from ...config.moe import moe_layer_pattern
    from ...model import GPTConfig
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}

    def settings(c: dict) -> dict:
        if not c.get("num_experts"):
            return {"--num-experts": None}
        values = {key: c.get(key, defaults[key]) for key in MOE_FLAGS}
        values["moe_layer_freq"] = moe_layer_pattern(values["moe_layer_freq"], c["num_layers"])
        values["moe_ffn_hidden_size"] = values["moe_ffn_hidden_size"] or c.get("ffn_hidden_size")
        # unset means the same function as its value here: routing in fp32, probabilities unscaled
        values["moe_router_dtype"] = values["moe_router_dtype"] or "fp32"
        values["moe_router_topk_scaling_factor"] = values["moe_router_topk_scaling_factor"] or 1.0
        return {flag: bool(values[key]) if isinstance(defaults[key], bool) else values[key]
                for key, flag in MOE_FLAGS.items()}
    old, new = settings(saved), settings(current)
    return [(flag, old.get(flag), new.get(flag)) for flag in (old if old.keys() == new.keys() else ["--num-experts"])
            if old.get(flag) != new.get(flag)]


# -- how a local shard was cut from the whole tensor ----------------------------------------------
def shard_layout(p: torch.nn.Parameter, tp_rank: int, tp_size: int, vocab_size: int) -> dict:
    info = param_info(p)
    is_tp = info.tensor_parallel
    tp_rank, tp_size = info.tp_place(tp_rank, tp_size)  # an MoE expert's: over ETP
    return {"tp": is_tp, "dim": info.partition_dim, "stride": info.partition_stride,
            "tp_rank": tp_rank if is_tp else 0, "tp_size": tp_size if is_tp else 1,
            "local_shape": list(p.shape), "rows": vocab_size if info.init_rows is not None else None}


def local_shard(full: torch.Tensor, p: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's shard of `full` (the whole tensor, vocabulary unpadded)."""
    info = param_info(p)
    if info.init_rows is not None:  # pad the vocabulary rows to this layout's size
        rows = p.shape[0] * (tp_size if info.tensor_parallel else 1)
        if full.shape[0] < rows:
            full = torch.cat([full, full.new_zeros((rows - full.shape[0],) + tuple(full.shape[1:]))])
    return shard(full, info, tp_rank, tp_size)


def target_layout(p: torch.nn.Parameter, tp_size: int) -> ShardLayout:
    """How this run cut `p`'s shard from the whole tensor (vocabulary padded as this run pads it)."""
    info = param_info(p)
    tp_size = info.tp_place(0, tp_size)[1]  # an MoE expert's: over ETP
    if not info.tensor_parallel or tp_size == 1:
        return ShardLayout(global_shape(p, tp_size if info.tensor_parallel else 1))
    return ShardLayout(global_shape(p, tp_size), info.partition_dim, info.partition_stride, tp_size)


# -- RNG states ------------------------------------------------------------------------------------
def rng_state(train_state: TrainState) -> tuple[dict, dict]:
    """RNG states as (tensors, JSON-safe values)."""
    np_state = np.random.get_state()
    tensors = {"rng/torch": torch.get_rng_state(), "rng/numpy": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available() and train_state.device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(train_state.device)
    for name, state in train_state.rng_tracker.get_states().items():
        tensors[f"rng/tracker/{name}"] = state
    py = random.getstate()
    values = {"python": [py[0], list(py[1]), py[2]], "numpy": [np_state[0], int(np_state[2]), int(np_state[3]),
                                                                  float(np_state[4])]}
    return tensors, values


def set_rng_state(train_state: TrainState, tensors: dict, values: dict) -> None:
    py = values["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = values["numpy"]
    np.random.set_state((n[0], tensors["rng/numpy"].numpy().astype(np.uint32), n[1], n[2], n[3]))
    torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors and train_state.device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng/cuda"], train_state.device)
    train_state.rng_tracker.set_states({k[len("rng/tracker/"):]: v for k, v in tensors.items()
                                    if k.startswith("rng/tracker/")})


# -- who saves, and reads, what --------------------------------------------------------------------
def _tp_owner(p, tp_rank: int) -> bool:
    """The copy that is saved: TP-sharded tensors on every TP rank, replicated ones on TP rank 0
    (the tied embedding's last-stage copy counts: its optimizer state is saved, tagged tied)."""
    return param_info(p).tensor_parallel or tp_rank == 0


def owned_pieces(train_state: TrainState, spread: bool = True) -> list[tuple]:
    """(param, lo, hi, master) pieces this rank saves, and on load reads: with the distributed
    optimizer its own slices; with the plain one whole parameters, spread over the DP ranks by
    size (`dp_owners`; `spread=False`: all on the first, --no-ckpt-fully-parallel-save). The same
    rule on every layout (see the module docstring)."""
    ps, opt = train_state.ps, train_state.optimizer
    pieces = opt.pieces()
    if opt.distributed and ps.instances > 1:  # the first of the replicated instances saves and reads
        pieces = [pc for pc in pieces if ps.instance_rank(param_info(pc[0]).expert_parallel) == 0]
    if not opt.distributed:
        # CP ranks are replicas like DP ranks: whole tensors spread over DP x CP, each written
        # once; under expert parallelism an expert's over its expert-DP group
        groups = [(pieces, ps.dp_cp_size, ps.dp_cp_rank)]
        if ps.separate_expert_grid:
            groups = [([pc for pc in pieces if param_info(pc[0]).expert_parallel == expert],
                       comm.group_size(ps.replica_group(expert)), ps.replica_rank(expert)) for expert in (False, True)]
        pieces = [pc for group, size, rank in groups
                  for pc, owner in zip(group, dp_owners([p.numel() for p, *_ in group], size if spread else 1))
                  if owner == rank]
    return [pc for pc in pieces if _tp_owner(pc[0], ps.tp_rank)]


def dp_owners(sizes: list[int], dp_size: int) -> list[int]:
    """The DP rank that owns each whole tensor: largest first, each to the least loaded rank
    (ties: the lowest), so DP replicas read and write about equal shares. A function of the
    sizes alone, hence the same on every DP rank."""
    load, owners = [0] * dp_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(dp_size), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners
