"""Throughput, FLOPs, memory and the log outputs (console line, JSONL)."""
from __future__ import annotations

import json
import math
import os
import resource
import time

import torch

# Dense bf16/fp16 tensor-core peak per device, TFLOP/s (vendor data sheets, SXM parts).
PEAK_TFLOPS_16BIT = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "V100": 125.0}


def num_floating_point_operations(c, batch_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward, no recompute), Megatron-LM's formula
    (Narayanan et al. 2021, Sec. 5.1, generalised to GQA, SwiGLU and Mixture-of-Experts):

        12·B·s·L·h² · [(1 + g/a + s/h)·(a·d/h) + V/(2·L·h)]  +  6·B·s·h · Σ_layers w

    with g query groups, a heads, d = kv channels, and w the MLP weights one token multiplies
    by, per h: f·n for a dense layer (f the MLP size; n = 3 matrices' worth with SwiGLU, else 2);
    for an MoE layer only what a token is routed through (Megatron-LM's num_floating_point_operations,
    active parameters only): its top-k experts (k·f_e·n, f_e = --moe-ffn-hidden-size), the shared
    expert (f_s·n), and the router (E) and shared-expert gate (1), which Megatron-LM's formula
    leaves out (6·B·s·h·E per MoE layer: 0.1% of Mixtral 8x7B's). MFU counts these FLOPs, so a
    sparse model's MFU is that of the work its tokens do, not of its parameter count.

    D MTP modules (--mtp-num-layers; Megatron-LM counts them alike) add D transformer layers (MoE
    as the last decoder layer), D output-layer products (V/(2·L·h) becomes (1 + D)·V/(2·L·h)) and
    their [h, 2h] eh_proj: 6·B·s·D·2h².

    With multi-latent attention the attention part is 6·B·s·(L + D)·(its weights per token +
    s·a·(d + dr + dv)); under DSA each query attends to min(k, s) keys and the indexer adds its own
    (dsa_indexer_flops). Gated DeltaNet layers count their own (gated_delta_net_flops) instead of
    softmax attention's, and --attention-output-gate adds the gate's [h, a·d] projection.
    """
    s, L, h = c.seq_length, c.num_layers, c.hidden_size
    a, g, d = c.num_attention_heads, c.num_query_groups, c.kv_channels
    D = getattr(c, "mtp_num_layers", None) or 0
    n = 3 if (c.swiglu or getattr(c, "quick_geglu", False)) else 2  # a gated fc1 is two matrices
    mlp = 0.0
    for layer in list(range(L)) + [L - 1] * D:  # an MTP layer is built as the last decoder layer
        if getattr(c, "num_experts", None) and c.is_moe_layer(layer):
            shared = c.moe_shared_expert_intermediate_size or 0
            mlp += (c.moe_router_topk * c.expert_ffn_hidden_size + shared) * n + c.num_experts \
                + (1 if shared and c.moe_shared_expert_gate else 0)
        else:
            mlp += c.ffn_hidden_size * n
    variant = getattr(c, "experimental_attention_variant", None)
    if getattr(c, "multi_latent_attention", False):  # MLA's projections and head sizes (model/mla.py)
        keys = min(c.dsa_indexer_topk, s) if variant == "dsa" else s  # DSA: each query's top-k keys
        attention = 6.0 * batch_size * s * (L + D) * (mla_weights_per_token(c) + keys * a * (
            c.qk_head_dim + c.qk_pos_emb_head_dim + c.v_head_dim))
        if variant == "dsa":
            attention += (L + D) * dsa_indexer_flops(c, batch_size)
    else:
        linear = sum(c.is_linear_attention_layer(n) for n in range(L)) if variant else 0
        gate = 6.0 * batch_size * s * h * a * d if getattr(c, "attention_output_gate", False) else 0.0
        attention = (L + D - linear) * (12.0 * batch_size * s * h * h * (1 + g / a + s / h) * (a * d / h) + gate)
        attention += linear * gated_delta_net_flops(c, batch_size)
    return attention + 6.0 * batch_size * s * h * (c.padded_vocab_size * (1 + D) + mlp + D * 2 * h)


def gated_delta_net_flops(c, batch_size: int, chunk: int = 64) -> float:
    """One gated DeltaNet layer's FLOPs (forward + backward: 3x the forward's 2 per multiply-add):
    in_proj and out_proj, the short convolution, and the chunked delta rule per value head and token:
    C·(3·dk + 2·dv) within its chunk of C (K·Kᵀ, W, Q·Kᵀ; U, the intra-chunk product) and 3·dk·dv
    against the state (W·S, its update, Q·S); the triangular solve's C³/3 per chunk is left out."""
    s, h = c.seq_length, c.hidden_size
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    weights = h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h + (2 * nk * dk + nv * dv) * c.linear_conv_kernel_dim
    rule = nv * (chunk * (3 * dk + 2 * dv) + 3 * dk * dv)
    return 6.0 * batch_size * s * (weights + rule)


def dsa_indexer_flops(c, batch_size: int) -> float:
    """One DSA layer's indexer: its projections (forward and backward), the scores of every query
    against every key (H·D per pair) for the top-k, and with --dsa-indexer-loss-coeff those scores
    again with their backward and the dense attention's target (n·(d + dr) per pair, forward only)."""
    s, h = c.seq_length, c.hidden_size
    heads, dim = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
    weights = heads * dim * c.q_lora_rank + dim * h + heads * h
    scores = 2.0 * batch_size * s * s * heads * dim
    loss = 3 * scores + 2.0 * batch_size * s * s * c.num_attention_heads * (c.qk_head_dim + c.qk_pos_emb_head_dim) \
        if c.dsa_indexer_loss_coeff else 0.0
    return 6.0 * batch_size * s * weights + scores + loss


def mla_weights_per_token(c) -> int:
    """The attention weights one token multiplies by in an MLA layer: the query projection (or
    its down- and up-projections), the key/value down- and up-projections, the output projection."""
    a, h, q_head = c.num_attention_heads, c.hidden_size, c.qk_head_dim + c.qk_pos_emb_head_dim
    query = a * q_head * h if c.q_lora_rank is None else c.q_lora_rank * (h + a * q_head)
    return query + (c.kv_lora_rank + c.qk_pos_emb_head_dim) * h + c.kv_lora_rank * a * (c.qk_head_dim + c.v_head_dim) \
        + a * c.v_head_dim * h


def peak_tflops(flag: float | None, dtype: torch.dtype) -> float | None:
    """--peak-tflops, else the table entry for this GPU in bf16; None when unknown (CPU)."""
    if flag:
        return flag
    if not torch.cuda.is_available() or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_TFLOPS_16BIT.items():
        if key in name:
            return value
    return None


def memory_string(device: torch.device) -> str:
    if device.type == "cuda":
        gib = 2**30
        return (f"mem alloc/peak/reserved (GiB): {torch.cuda.memory_allocated() / gib:.2f}/"
                f"{torch.cuda.max_memory_allocated() / gib:.2f}/{torch.cuda.memory_reserved() / gib:.2f}")
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"max RSS (GiB): {rss_kib / 2**20:.2f}"


def memory_record(device: torch.device) -> dict:
    """--log-memory-to-tensorboard: memory in bytes, for the JSONL record and the trackers."""
    if device.type == "cuda":
        return {"mem_allocated_bytes": torch.cuda.memory_allocated(), "mem_max_allocated_bytes":
                torch.cuda.max_memory_allocated(), "mem_reserved_bytes": torch.cuda.memory_reserved()}
    return {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def console_line(r: dict, train_iters: int, memory: str, eta_s: float, throughput: bool = True) -> str:
    """Megatron-LM's log line; TFLOP/s and MFU only with `throughput` (--log-throughput)."""
    parts = [
        f" iteration {r['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {r['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {r['elapsed_ms']:.1f}",
    ]
    if throughput:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {r['tflops_per_gpu']:.2f}")
        if r.get("mfu") is not None:
            parts.append(f"MFU: {100 * r['mfu']:.1f}%")
    parts += [
        f"learning rate: {r['lr']:.6E}",
        f"global batch size: {r['global_batch_size']:5d}" if "global_batch_size" in r else None,
        f"lm loss: {r['lm_loss']:.6E}",
    ]
    parts = [p for p in parts if p is not None]
    if r.get("loss_scale") is not None:
        parts.append(f"loss scale: {r['loss_scale']:.1f}")
    if r.get("grad_norm") is not None:  # None on a step skipped for fp16 overflow
        parts.append(f"grad norm: {r['grad_norm']:.3f}")
    k = 1
    while r.get(f"mtp_{k}_loss") is not None:  # MTP, as Megatron-LM names them: "mtp_1 loss", ...
        parts.append(f"mtp_{k} loss: {r[f'mtp_{k}_loss']:.6E}")
        k += 1
    for key, label in (("load_balancing_loss", "load balancing loss"), ("z_loss", "z loss")):
        if r.get(key) is not None:  # MoE, as Megatron-LM names them
            parts.append(f"{label}: {r[key]:.6E}")
    if r.get("dsa_indexer_loss") is not None:  # DSA, as Megatron-LM names it
        parts.append(f"indexer loss: {r['dsa_indexer_loss']:.6E}")
    if r.get("expert_tokens_min") is not None:
        parts.append(f"expert tokens min/max: {r['expert_tokens_min']}/{r['expert_tokens_max']}")
    if r.get("max_attention_logit") is not None:  # --qk-clip
        parts.append(f"max attention logit: {r['max_attention_logit']:.3f}")
    if r.get("num_zeros_in_grad") is not None:
        parts.append(f"num zeros: {r['num_zeros_in_grad']}")
    if r.get("params_norm") is not None:
        parts.append(f"params norm: {r['params_norm']:.3f}")
    for key, label in (("skipped_iterations", "skipped iterations"), ("nan_iterations", "nan iterations")):
        if r.get(key):
            parts.append(f"{label}: {r[key]}")
    parts.append(f"tokens/s: {r['tokens_per_sec']:.0f}")
    parts += [memory, f"ETA: {format_eta(eta_s)}"]
    return " | ".join(parts) + " |"


class JsonlWriter:
    """Appends one JSON object per line; flushed after each, so a crash keeps what was logged."""

    def __init__(self, path: str | None):
        self.file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class Timer:
    """Wall-clock timer that waits for queued GPU work before reading the clock."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def reset(self):
        self._sync()
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        self._sync()
        return time.perf_counter() - self.start


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
