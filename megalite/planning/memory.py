"""What one GPU of a layout holds, computed from the same RunConfig the trainer runs: parameters
(exact for megalite's model), gradients, optimizer state and ZeRO's working set for every
data-parallel sharding strategy, and activations at the pipeline schedule's peak.

Memory per GPU (Megatron-LM's accounting, bytes per parameter; d = DP size), for the strategy of
--data-parallel-sharding-strategy and, side by side, for every other one:
  params     4 (fp32) or 2 (--bf16 / --fp16); / d under ZeRO-3 (optim_grads_params)
  grads      4: the contiguous fp32 gradient buffer, whatever the parameter dtype; / d under
             ZeRO-2 (optim_grads) and ZeRO-3
  optimizer  Adam m and v: 8 (4 with bf16 / fp16 moments: --use-precision-aware-optimizer
             --exp-avg-dtype / --exp-avg-sq-dtype; --optimizer muon: 4 of momentum (2 in bf16 /
             fp16) for each of Muon's matrices' elements, the scalar optimizer's 8 or 4 for the
             rest), plus a master copy when parameters are 16-bit (4 fp32, 2 with
             --main-params-dtype fp16);
             / d under ZeRO-1 (optim, --use-distributed-optimizer), ZeRO-2 and ZeRO-3; with
             --optimizer-cpu-offload the fraction --optimizer-offload-fraction of it is host memory
  working set  ZeRO-2/3 only, what comes and goes during a step: gradients pass through
             bucket-sized fp32 staging buffers (at most 4 at once: 2 reducing, 2 filling, so the
             4 biggest buckets);
             ZeRO-3 gathers whole parameters per unit (the chunk's own: an untied output layer,
             the final norm; plus the biggest of the embedding and the layers in use, and with
             --overlap-param-gather the prefetched next one too), in the parameter dtype
  padding    each bucket is padded to a multiple of d: at most (d-1) elements per bucket of the
             parameter and gradient buffers, stated as a bound, not added to the total
  activations  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
             Models"), Table 2, per layer and micro-batch in 16-bit:
                 s·b·h·(10 + 24/t + 5·a·s/(h·t))    TP
                 s·b·h·(34 + 5·a·s/h)/t             TP + sequence parallel
             selective recompute (or flash attention) drops the 5·a·s/h term (the s² attention
             scores are recomputed / never stored); full recompute keeps only each recomputed
             group's 2·s·b·h input (/t with SP). The 24 is 8 (Q, K, V, attention output) + 16 (a
             4h GeLU MLP); it is scaled here for GQA (K, V by groups/heads), other MLP sizes and
             SwiGLU (2x: megalite keeps fc1's [gate; up], silu(gate) and their product); RoPE adds
             the rotated Q and K (2 + 2·groups/heads); both as `--dry-run` measures. The first pipeline stage holds the activations of the micro-batches
             in flight: min(p, m) with 1F1B, p + (p-1)/v chunks' worth with the interleaved
             schedule (Sec. 4.2.3). The last stage adds the output layer and fp32 logits,
             4·s·b·h·(1 + v/2h)/t (the vocab-parallel loss keeps one logits-sized
             tensor in the logits' dtype). fp32 activations count double. Context parallelism
             (--context-parallel-size c) divides every term by c (s -> s/c per rank; the scores are
             [s/c, s]), and adds the K and V of the whole sequence that its all-gather keeps for
             backward, 4·s·b·h·(groups/heads)/t per layer. An FP8 layer (--fp8-format, per-tensor
             scales) keeps its linears' four inputs as 1-byte casts (fp8_saved_bytes).
Parameter counts are exact for megalite's model (checked against the `memory_footprint`
record of real runs in tests/test_plan.py): padded vocabulary, the tied embedding's copy on the
last stage when PP > 1, position embeddings on the first stage, biases and norms per the flags;
an MoE layer's E/EP local experts, router and shared expert (planning/moe.py). Expert weights
are sharded by ZeRO over the expert-data-parallel group (DP x CP / EP ranks), the rest over
DP x CP; an MoE layer's activations are planning/moe.py's, at balanced routing.
Not counted: the CUDA context, NCCL buffers, allocator fragmentation, temporary buffers (a few GB).

Pipeline bubble (Narayanan et al. 2021, Sec. 2.2): (p - 1) / (v·m + p - 1), m micro-batches per
iteration, v virtual stages per rank. FLOPs: megalite.runtime.metrics.num_floating_point_operations.
"""
from __future__ import annotations

import math

from ..config.sharding import ShardingStrategy
from .attention_variant import (dsa_activation_bytes_per_token, gdn_activation_bytes_per_token, gdn_params,
                                indexer_params, linear_pattern, output_gate_params)
from .context_parallel import cp_attention_terms
from .mla import mla_activation_coefficients, mla_params
from .schedule import is_post_process, loss_rank, zero_bubble_in_flight
from .muon import expert_vector_params, layer_vector_params
from .moe import (chunk_layers, expert_params, expert_tp, local_expert_params, moe_layer_params,
                  moe_mlp_activation_bytes, moe_pattern)

# -- parameters --------------------------------------------------------------------------------
def layer_params(c, moe: bool = False, linear: bool = False) -> tuple[int, int]:
    """(elements sharded over TP, on one TP rank; elements replicated on every TP rank) of one
    transformer layer, as megalite builds it; of an MoE layer (`moe`) all but its routed experts
    (planning/moe.py: local_expert_params); of a gated DeltaNet layer (`linear`) its own attention."""
    h, t = c.model.hidden_size, c.parallel.tensor_model_parallel_size
    bias = not (not c.model.add_bias_linear)
    norm = h * (2 if c.model.normalization == "LayerNorm" else 1)
    qkv = (c.model.num_attention_heads + 2 * c.model.num_query_groups) * c.model.kv_channels // t
    proj_in = c.model.num_attention_heads * c.model.kv_channels // t
    sharded = qkv * h + proj_in * h + (qkv if bias else 0)
    if c.model.add_qkv_bias and not bias:  # --add-qkv-bias: the QKV projection's bias alone
        sharded += qkv
    if c.model.softmax_type == "learnable":  # one sink logit per head, sharded with the heads
        sharded += c.model.num_attention_heads // t
    replicated = 2 * norm + (h if bias else 0)  # two norms; the projection's row-parallel bias is whole
    if c.model.qk_layernorm:  # the q and k norms, kv_channels wide, whole on every TP rank
        replicated += 2 * norm // h * c.model.kv_channels
    if c.model.multi_latent_attention:  # its own projections and latent norms (planning/mla.py), DSA's indexer
        sharded, replicated = mla_params(c)
        replicated += 2 * norm + indexer_params(c)
    elif linear:  # a gated DeltaNet layer (planning/attention_variant.py)
        sharded, replicated = gdn_params(c)
        replicated += 2 * norm
    else:  # --attention-output-gate's rows in linear_qkv
        sharded += output_gate_params(c)
    if moe:
        mlp_sharded, mlp_replicated = moe_layer_params(c)
    else:
        fc1 = c.model.ffn_hidden_size * (2 if c.model.gated_linear_unit else 1) // t
        mlp_sharded, mlp_replicated = fc1 * h + c.model.ffn_hidden_size // t * h + (fc1 if bias else 0), \
            (h if bias else 0)
    return sharded + mlp_sharded, replicated + mlp_replicated


def mtp_params(c) -> tuple[int, int, int]:
    """(elements sharded over TP on one TP rank, replicated, local expert elements) of the D MTP
    modules (model/mtp.py): each a transformer layer built as the last decoder layer, its [h, 2h]
    eh_proj (column-parallel) and three norms (enorm, hnorm, final_layernorm)."""
    depth = c.model.mtp_num_layers or 0
    h, t = c.model.hidden_size, c.parallel.tensor_model_parallel_size
    moe = moe_pattern(c)[-1]
    sharded, replicated = layer_params(c, moe)
    norm = h * (2 if c.model.normalization == "LayerNorm" else 1)
    experts = local_expert_params(c) if moe else 0
    return depth * (sharded + 2 * h * h // t), depth * (replicated + 3 * norm), depth * experts


def stage_layer_params(c, pp_rank: int) -> tuple[int, int]:
    """(dense elements, expert elements) of the transformer layers on one GPU of stage `pp_rank`:
    expert weights are reduced and sharded over the expert-data-parallel group, the rest over
    DP x CP."""
    pattern, linear = moe_pattern(c), linear_pattern(c)
    dense = sum(sum(layer_params(c, pattern[n], linear[n])) for chunk in chunk_layers(c, pp_rank) for n in chunk)
    experts = sum(pattern[n] for chunk in chunk_layers(c, pp_rank) for n in chunk) * (
        local_expert_params(c) if c.model.num_experts else 0)
    return dense, experts


def stage_param_split(c, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameters held by one GPU of pipeline stage `pp_rank` (every TP and DP
    rank of a stage holds as many)."""
    h, t = c.model.hidden_size, c.parallel.tensor_model_parallel_size
    v = c.parallel.virtual_pipeline_model_parallel_size
    n, experts = stage_layer_params(c, pp_rank)
    word = c.model.padded_vocab_size // t * h
    for chunk in range(v):
        pre, post = pp_rank == 0 and chunk == 0, is_post_process(c, pp_rank, chunk)
        if pre:
            n += word
            if c.model.position_embedding_type == "learned_absolute":
                n += c.model.max_position_embeddings * h
        if post:
            n += h * (2 if c.model.normalization == "LayerNorm" else 1)  # final norm
            mtp = bool(c.model.mtp_num_layers)
            if c.model.untie_embeddings_and_output_weights or not pre:
                n += word  # output layer, or the tied embedding's copy on the last stage
            if mtp and not pre:  # MTP's copy of the embedding (with a tied one, the counted copy above)
                n += word if c.model.untie_embeddings_and_output_weights else 0
                if c.model.position_embedding_type == "learned_absolute":
                    n += c.model.max_position_embeddings * h
            sharded, replicated, local_experts = mtp_params(c)
            n, experts = n + sharded + replicated, experts + local_experts
    return n, experts


def stage_matrix_params(c, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) elements of --optimizer muon's matrices on one GPU of stage `pp_rank`: every
    2-D weight of the transformer (and MTP) layers; the tables, norms and biases are the rest."""
    pattern, linear = moe_pattern(c), linear_pattern(c)
    layers = [pattern[n] for chunk in chunk_layers(c, pp_rank) for n in chunk]
    experts_each = local_expert_params(c) - expert_vector_params(c) if c.model.num_experts else 0
    dense = sum(sum(layer_params(c, pattern[n], linear[n])) - layer_vector_params(c, pattern[n])
                for chunk in chunk_layers(c, pp_rank) for n in chunk)
    experts = sum(layers) * experts_each
    depth = c.model.mtp_num_layers or 0
    if depth and pp_rank == c.parallel.pipeline_model_parallel_size - 1:  # MTP: its layer and eh_proj
        h, moe = c.model.hidden_size, pattern[-1]
        dense += depth * (sum(layer_params(c, moe)) - layer_vector_params(c, moe)
                          + 2 * h * h // c.parallel.tensor_model_parallel_size)
        experts += depth * experts_each if moe else 0
    return dense, experts


def stage_params(c, pp_rank: int) -> int:
    """Parameters held by one GPU of pipeline stage `pp_rank`, experts included."""
    return sum(stage_param_split(c, pp_rank))


def total_params(c) -> int:
    """Parameters of the whole model, each counted once (as the trainer's start-up line): every
    expert of every MoE layer."""
    h, t = c.model.hidden_size, c.parallel.tensor_model_parallel_size
    pattern = moe_pattern(c)
    n = 0
    for moe, linear in zip(pattern, linear_pattern(c)):
        sharded, replicated = layer_params(c, moe, linear)
        n += sharded * t + replicated + (c.model.num_experts * expert_params(c) if moe else 0)
    sharded, replicated, _ = mtp_params(c)
    depth, moe = c.model.mtp_num_layers or 0, moe_pattern(c)[-1]
    n += sharded * t + replicated + (depth * c.model.num_experts * expert_params(c) if moe else 0)
    n += c.model.padded_vocab_size * h * (2 if c.model.untie_embeddings_and_output_weights else 1)
    if c.model.position_embedding_type == "learned_absolute":
        n += c.model.max_position_embeddings * h
    return n + h * (2 if c.model.normalization == "LayerNorm" else 1)


# -- activations -------------------------------------------------------------------------------
def recompute_setting(c) -> tuple[str | None, str | None, int]:
    granularity = c.recompute.recompute_granularity  # validation resolved --recompute-activations
    method = c.recompute.recompute_method or "uniform"
    k = c.recompute.recompute_num_layers or 1
    return granularity, (method if granularity == "full" else None), k


def layer_activation_bytes(c, moe: bool = False, cp_type: str | None = None, linear: bool = False) -> tuple[float, float]:
    """(bytes one layer stores for one micro-batch, bytes of its input alone), Korthikanti et al.
    2022 Table 2, for this TP / SP / recompute setting; an MoE layer (`moe`) keeps its norms'
    and attention's part and planning/moe.py's for the MLP; `cp_type`: the layer's --cp-comm-type
    (default: the first layer's)."""
    cp = c.parallel.context_parallel_size
    s, b, h = c.model.seq_length // cp, c.training.micro_batch_size, c.model.hidden_size  # this rank's s/c tokens
    a, t = c.model.num_attention_heads, c.parallel.tensor_model_parallel_size
    sp = bool(c.parallel.sequence_parallel) and t > 1
    granularity, _, _ = recompute_setting(c)
    # 24 = 8 attention (Q, K, V, context) + 16 MLP (4h GeLU): scaled for GQA, the MLP size, SwiGLU;
    # under CP what the layer's --cp-comm-type keeps besides (planning/context_parallel.py: the
    # all-gathered K and V of the whole sequence, Ulysses' reordered copies, the ring's Q and lse)
    cp_type = cp_type or c.parallel.cp_comm_type[0]
    hierarchy = c.parallel.hierarchical_context_parallel_sizes
    cp_extra, keeps_scores = cp_attention_terms(cp_type, cp, a // t, c.model.num_query_groups // t, h // t,
                                                hierarchy[0] if hierarchy else None)
    attention = 4 + 4 * c.model.num_query_groups / a + cp_extra
    if c.model.uses_rope:  # the rotated Q and K are new tensors, kept beside QKV's output
        attention += 2 + 2 * c.model.num_query_groups / a
    latents = 0.0
    if c.model.multi_latent_attention:  # planning/mla.py: per-head tensors, and the latents
        attention, latents = mla_activation_coefficients(c)
    variant = 0.0  # bytes per token of the attention variants (planning/attention_variant.py)
    if linear:  # a gated DeltaNet layer: its own tensors instead of softmax attention's
        attention, keeps_scores = 0.0, False
        variant = gdn_activation_bytes_per_token(c, granularity == "selective")
    elif c.model.experimental_attention_variant == "dsa":  # no [s, s] scores: the indices, the indexer's
        keeps_scores, variant = False, dsa_activation_bytes_per_token(c)
    elif c.model.attention_output_gate:  # the gate's logits and sigmoid beside the context
        attention += 4 * c.model.num_attention_heads * c.model.kv_channels / h
    # GeLU keeps fc1's output and GeLU's (4f/h in 16-bit); megalite's SwiGLU keeps fc1's [gate; up],
    # silu(gate) and their product (4f/h + 2f/h + 2f/h): twice GeLU's for the same f
    mlp = 4 * c.model.ffn_hidden_size / h * (2.0 if c.model.gated_linear_unit else 1.0)
    # the scores of s/c queries against all s keys: softmax (2), and with attention dropout its
    # mask (1) and output (2)
    per_score = 5 if c.model.attention_dropout > 0 else 2
    # (none kept by flash-attn, nor by packed documents' tiled kernel: model/varlen_attention.py)
    fused = c.kernels.use_flash_attn or c.data.reset_attention_mask
    scores = 0.0 if (granularity == "selective" or fused or not keeps_scores) else \
        per_score * a * c.model.seq_length / h
    # 10 = two norm inputs (4), the QKV and fc1 inputs (4), two hidden-dropout masks (2: none without dropout)
    replicated = 8 + (2 if c.model.hidden_dropout > 0 else 0)
    if moe:  # no dense fc1 (its input and activations): the MoE MLP's own, in bytes
        replicated, mlp = replicated - 2, 0.0
    coeff = (replicated + latents + attention + mlp + scores) / t if sp else \
        replicated + latents + (attention + mlp + scores) / t
    scale = 1.0 if (c.optimizer.bf16 or c.optimizer.fp16) else 2.0  # the formula is for 16-bit
    return s * b * h * coeff * scale + s * b * variant + (moe_mlp_activation_bytes(c) if moe else 0.0), \
        2 * s * b * h / (t if sp else 1) * scale


def fp8_saved_bytes(c, moe: bool = False) -> float:
    """What an FP8 layer (--fp8-format) keeps less than layer_activation_bytes says: its linears
    save their input as the FP8 cast (1 byte an element) instead of the 16-bit (or fp32) tensor:
    the QKV and fc1 inputs (the norms' outputs), the attention output projection's input and
    fc2's [s, b, f] input, as `--dry-run` measures. Block scaling and --no-fp8-wgrad keep the
    unscaled input for the weight gradient (nothing less); MLA's projections and the routed
    experts are not counted (their own terms stay 16-bit: an over-estimate)."""
    f = c.fp8
    if not f.enabled or f.fp8_recipe == "blockwise" or not f.fp8_wgrad or c.model.multi_latent_attention:
        return 0.0
    cp, t = c.parallel.context_parallel_size, c.parallel.tensor_model_parallel_size
    s, b, h = c.model.seq_length // cp, c.training.micro_batch_size, c.model.hidden_size
    sp = bool(c.parallel.sequence_parallel) and t > 1
    replicated = 1 if moe else 2  # the QKV input, and the dense fc1's (an MoE layer has none)
    split = 1 + (0 if moe else c.model.ffn_hidden_size / h)  # the context, fc2's input: split over TP
    units = (replicated + split) / t if sp else replicated + split / t
    scale = 1.0 if (c.optimizer.bf16 or c.optimizer.fp16) else 2.0
    return s * b * h * units * (2 * scale - 1)


def in_flight_chunks(c, pp_rank: int) -> int:
    """Model chunks' worth of micro-batch activations pipeline rank `pp_rank` holds at its peak:
    Megatron-LM's warm-up count plus one, at most all m·v of them."""
    p, v, m = c.parallel.pipeline_model_parallel_size, c.parallel.virtual_pipeline_model_parallel_size, c.training.num_microbatches
    if p == 1:
        return 1
    zero_bubble = zero_bubble_in_flight(c, pp_rank)  # zb_h1 / zbv: their order's peak
    if zero_bubble is not None:
        return zero_bubble
    warmup = (p - pp_rank - 1) * 2 + (v - 1) * p if v > 1 else p - pp_rank - 1
    return min(warmup + 1, m * v)


def chunk_activation_bytes(c, pp_rank: int) -> tuple[float, float]:
    """(what a forward of one of stage `pp_rank`'s model chunks keeps for backward, the mean over
    its chunks; the most one group of layers rebuilt by full recompute holds in backward)."""
    pattern, linear = moe_pattern(c), linear_pattern(c)
    types = c.parallel.cp_comm_type
    _, checkpoint = layer_activation_bytes(c)
    # per (MoE?, --cp-comm-type, DeltaNet?): one type, or one per layer
    kinds = {False, True} if any(pattern) else {False}
    per = {(m, t, lin): layer_activation_bytes(c, m, t, lin)[0] for m in kinds for t in set(types)
           for lin in set(linear)}
    granularity, method, k = recompute_setting(c)
    kept, transient = [], 0.0
    for chunk in chunk_layers(c, pp_rank):
        full = [per[(bool(pattern[n]), types[min(n, len(types) - 1)], linear[n])]
                - (fp8_saved_bytes(c, bool(pattern[n])) if c.fp8.layer_in_fp8(n, c.model.num_layers) else 0.0)
                for n in chunk]
        n = len(full)
        if granularity == "full":
            if method == "block":
                kept.append(min(k, n) * checkpoint + sum(full[min(k, n):]))
            else:  # uniform: the input of every group of k layers; one group is rebuilt at a time
                kept.append(math.ceil(n / k) * checkpoint)
            transient = max(transient, sum(sorted(full)[-min(k, n):]))
        else:
            kept.append(sum(full))
    return sum(kept) / len(kept), transient


def stage_activation_bytes(c, pp_rank: int, rebuilt: bool = True) -> float:
    """Activations of pipeline stage `pp_rank` at its peak: what the forward passes in flight keep
    for backward, plus (`rebuilt`, full recompute) the group of layers rebuilt in backward at a
    time. `--dry-run` measures the first part."""
    v = c.parallel.virtual_pipeline_model_parallel_size
    s, b, h, t = c.model.seq_length, c.training.micro_batch_size, c.model.hidden_size, c.parallel.tensor_model_parallel_size
    s //= c.parallel.context_parallel_size  # this rank's tokens under CP
    sp = bool(c.parallel.sequence_parallel) and t > 1
    kept, transient = chunk_activation_bytes(c, pp_rank)
    if not rebuilt:
        transient = 0.0
    chunks = in_flight_chunks(c, pp_rank)
    total = chunks * kept + transient
    scale = 1.0 if (c.optimizer.bf16 or c.optimizer.fp16) else 2.0
    if pp_rank == 0 and c.model.hidden_dropout > 0:  # embedding dropout mask per micro-batch in flight
        total += chunks / v * s * b * h / (t if sp else 1)
    if pp_rank == loss_rank(c):  # final norm output, output-layer input, fp32 logits (one micro-batch)
        # (one logits-sized tensor in the logits' dtype: tensor_parallel/cross_entropy.py)
        logits = 4 * s * b * h / t * (1 + c.model.padded_vocab_size / (2 * h)) * scale
        total += logits
        if c.model.mtp_num_layers:  # MTP, per depth and micro-batch in flight on the last chunk: its layer,
            # the enorm / hnorm inputs and the [s, b, 2h] eh_proj input (8·s·b·h), and its own logits
            per_depth = layer_activation_bytes(c, moe_pattern(c)[-1])[0] + 8 * s * b * h / (t if sp else 1) * scale
            total += c.model.mtp_num_layers * (max(1, chunks // v) * per_depth + logits)
    return total


# -- data-parallel sharding ------------------------------------------------------------------------


def unit_params(c, pp_rank: int) -> tuple[int, list[int]]:
    """ZeRO-3 units of one GPU of stage `pp_rank` (distributed/zero3.py): (the largest chunk's own
    unit: an untied output layer and the final norm; the other units: embedding and layers, an MoE
    layer with this rank's experts), in elements. A word embedding that is the output layer too
    is the embedding's unit, gathered again for the output projection alone."""
    h, t = c.model.hidden_size, c.parallel.tensor_model_parallel_size
    v = c.parallel.virtual_pipeline_model_parallel_size
    word = c.model.padded_vocab_size // t * h
    pos = c.model.max_position_embeddings * h if c.model.position_embedding_type == "learned_absolute" else 0
    tied = not c.model.untie_embeddings_and_output_weights
    pattern = moe_pattern(c)
    linear = linear_pattern(c)
    own, units = 0, [sum(layer_params(c, pattern[n], linear[n])) + (local_expert_params(c) if pattern[n] else 0)
                     for chunk in chunk_layers(c, pp_rank) for n in chunk]
    for chunk in range(v):
        pre, post = pp_rank == 0 and chunk == 0, is_post_process(c, pp_rank, chunk)
        mtp = post and bool(c.model.mtp_num_layers)
        n = 0
        if post:
            n += h * (2 if c.model.normalization == "LayerNorm" else 1)
            n += word if (not tied or not (pre or mtp)) else 0  # an untied output layer, a tied copy without MTP
        if pre or mtp:  # the embedding (MTP's copy on the last stage: a unit of its own)
            units.append(word + pos)
        if mtp:  # each MTP module is a unit
            sharded, replicated, experts = mtp_params(c)
            units += [(sharded + replicated + experts) // c.model.mtp_num_layers] * c.model.mtp_num_layers
        own = max(own, n)
    return own, units


def bucket_sizes(c, pp_rank: int, strategy: ShardingStrategy) -> list[int]:
    """Approximate bucket sizes (elements) of the sharded-gradient layouts (distributed/buckets.py):
    a vocabulary table of at least --ddp-bucket-size elements gets a bucket of its own; ZeRO-3
    cuts every unit into buckets, ZeRO-2 only the stage's parameters as a whole."""
    bs, h, t = c.ddp.ddp_bucket_size, c.model.hidden_size, c.parallel.tensor_model_parallel_size
    word = c.model.padded_vocab_size // t * h
    v = c.parallel.virtual_pipeline_model_parallel_size
    tables = 0  # word embedding and output layer tables on this stage
    for chunk in range(v):
        pre, post = pp_rank == 0 and chunk == 0, is_post_process(c, pp_rank, chunk)
        mtp = post and not pre and bool(c.model.mtp_num_layers)  # MTP's copy of the embedding
        tables += int(pre) + int(post and (c.model.untie_embeddings_and_output_weights or not pre)) \
            + int(mtp and c.model.untie_embeddings_and_output_weights)
    tables = tables if word >= bs else 0
    own, units = unit_params(c, pp_rank)
    parts = units + [own] if strategy.shards_params else [stage_params(c, pp_rank)]
    sizes, left = [word] * tables, tables
    for u in sorted(parts, reverse=True):
        cut = min(left, u // word) if tables else 0  # the tables come out of the units holding them
        left -= cut
        u -= cut * word
        sizes += [bs] * (u // bs) + ([u % bs] if u % bs else [])
    return sizes


STATE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def optimizer_state_bytes(o) -> int:
    """Optimizer state per parameter, for an OptimizerConfig, masters aside: Adam's two moments (4
    bytes each, or 2 in bf16 / fp16 with --use-precision-aware-optimizer), SGD's momentum (4);
    with --optimizer muon the scalar optimizer's (Adam's, or Lion's 4), Muon's matrices taking
    `muon_momentum_bytes` instead."""
    adam = o.optimizer == "adam" or (o.optimizer == "muon" and o.muon_scalar_optimizer == "adam")
    if adam:
        return STATE_BYTES[o.exp_avg_dtype] + STATE_BYTES[o.exp_avg_sq_dtype]
    return 4 if o.optimizer == "muon" or o.sgd_momentum else 0


def muon_momentum_bytes(o) -> int:
    """Muon's momentum per matrix element: 4, or 2 with --exp-avg-dtype bf16 / fp16."""
    return STATE_BYTES[o.exp_avg_dtype]


def optimizer_bytes_per_param(o) -> int:
    """`optimizer_state_bytes` plus, for 16-bit parameters, the master weight (4, or 2 with
    --main-params-dtype fp16)."""
    return optimizer_state_bytes(o) + (STATE_BYTES[o.main_params_dtype] if (o.bf16 or o.fp16) else 0)


def strategy_bytes(c, pp_rank: int, strategy: ShardingStrategy) -> dict:
    """Bytes per GPU of stage `pp_rank` under `strategy` (module docstring). ZeRO shards over
    DP x CP (context-parallel ranks hold the same parameters), expert weights over the expert-DP
    group (DP x CP / EP: the ranks holding the same experts); each divided into
    --num-distributed-optimizer-instances instances."""
    d = c.parallel.data_parallel_size * c.parallel.context_parallel_size
    s_opt, s_grads, s_params = strategy.shards_optimizer, strategy.shards_grads, strategy.shards_params
    dense, experts = stage_param_split(c, pp_rank)
    p = c.parallel
    n, d_expert = dense + experts, p.tensor_model_parallel_size * d // (expert_tp(c) * p.expert_model_parallel_size)
    if s_opt:  # --num-distributed-optimizer-instances: sharded within an instance, replicated across
        d, d_expert = d // p.num_distributed_optimizer_instances, d_expert // p.num_distributed_optimizer_instances

    def per_rank(nbytes: float, shard: bool) -> float:  # `nbytes` per parameter, sharded or not
        return dense * nbytes / d + experts * nbytes / d_expert if shard else n * nbytes
    sixteen_bit = bool(c.optimizer.bf16 or c.optimizer.fp16)
    pb = 2 if sixteen_bit else 4
    state = optimizer_state_bytes(c.optimizer)  # --optimizer muon: the scalar optimizer's; its matrices below
    opt_per_param = optimizer_bytes_per_param(c.optimizer)
    offload = c.optimizer.optimizer_offload_fraction if c.optimizer.optimizer_cpu_offload else 0.0
    if s_opt and offload and not sixteen_bit:
        opt_per_param += 4  # an offloaded fp32 parameter gets a host master of its own
    optimizer = per_rank(opt_per_param, s_opt)
    if c.optimizer.optimizer == "muon":  # momentum: 4 (or 2) bytes per matrix element instead of `state`
        m_dense, m_experts = stage_matrix_params(c, pp_rank)
        optimizer -= (state - muon_momentum_bytes(c.optimizer)) * (m_dense / d + m_experts / d_expert if s_opt else m_dense + m_experts)
    own, units = unit_params(c, pp_rank)
    v = c.parallel.virtual_pipeline_model_parallel_size
    if s_params:
        buckets = v * (c.model.num_layers // (c.parallel.pipeline_model_parallel_size * v) + 3)
    else:
        # expert weights are buckets of their own (reduced over another group)
        buckets = math.ceil(dense / c.ddp.ddp_bucket_size) + math.ceil(experts / c.ddp.ddp_bucket_size) \
            + (v + 1 if s_grads else 0)
    gathered = staging = 0.0
    if s_grads:
        staging = 4 * sum(sorted(bucket_sizes(c, pp_rank, strategy))[-4:])
    if s_params:  # the unit in use, and with --overlap-param-gather the next one, prefetched
        gathered = (own + sum(sorted(units)[-(2 if c.ddp.overlap_param_gather else 1):])) * pb
    out = {"params": per_rank(pb, s_params), "grads": per_rank(4, s_grads),
           "optimizer": optimizer * (1 - offload), "optimizer_host": optimizer * offload,
           "working_set": gathered + staging, "gathered_params": gathered, "staging_grads": staging,
           "buckets": buckets, "padding_max": (d - 1) * buckets * (pb + 4) if s_opt else 0}
    return out


