"""Mixture-of-Experts arithmetic for the planner: which layers of a pipeline stage are MoE, the
expert parameters one GPU holds, the parameters a token is routed through (active), an MoE
layer's activations, and the token traffic of expert parallelism in one iteration.

Placement (megalite/model/moe/, parallel_state.py): each MoE layer's E experts are split over the
EP ranks (E/EP each), each expert over the ETP ranks (--expert-tensor-parallel-size, by default
TP) as the dense MLP over TP; the router ([E, h]) and the shared expert's gate ([1, h]) are
replicated, the shared expert is a dense MLP. The expert grid ETP x EP x expert-DP takes a
pipeline stage's TP x DP x CP ranks, so an expert has TP·DP·CP / (ETP·EP) replicas (the
expert-data-parallel group): its gradients are reduced, and ZeRO shards its state, over those,
dense weights over DP x CP.

Routing is taken as balanced (each expert gets T·k/E of the T·k routed copies of T tokens), as
the dry run's meta device assumes: dropless routing moves memory and traffic towards the experts
that receive more (up to all T·EP·k copies of the EP group on one rank), a capacity factor caps
them. Traffic per rank, per MoE layer and micro-batch (T = the ETP group's tokens, s·b/CP·ETP/TP
under sequence parallelism: each ETP rank gathers them and sends every routed copy, to compute
its slice of each expert; with ETP 1 a rank sends only its own s·b/(CP·TP)):
  alltoall   4 all-to-alls (dispatch and combine, forward and backward) of the T·k routed rows
             of h values; (EP-1)/EP of them leave the rank
  allgather  the EP group's tokens all-gathered and the outputs reduce-scattered, forward and
             backward: 4 collectives, each sending (EP-1)·T rows of h values
Full recompute repeats the forward's two for each layer it rebuilds.
"""
from __future__ import annotations

from ..config.moe import moe_layer_pattern
from ..parallel_state import stage_layers
from .schedule import v_shaped


def moe_pattern(c) -> list[bool]:
    """Per layer, whether it is an MoE layer (all False for a dense model)."""
    m = c.model
    return moe_layer_pattern(m.moe_layer_freq, m.num_layers) if m.num_experts else [False] * m.num_layers


def chunk_layers(c, pp_rank: int) -> list[list[int]]:
    """The global layer numbers of each model chunk of pipeline rank `pp_rank`."""
    p, v = c.parallel.pipeline_model_parallel_size, c.parallel.virtual_pipeline_model_parallel_size
    return [list(range(first, first + n))
            for first, n in stage_layers(c.model.num_layers, p, v, pp_rank, c.parallel.pipeline_model_parallel_layout,
                                         v_shaped(c))]


def _expert_parts(c, ffn: int) -> tuple[int, int]:
    """(elements split over TP, elements whole on every TP rank) of an MLP of `ffn` hidden units:
    fc1 [ffn (x2 gated), h] and fc2 [h, ffn], with biases unless --disable-bias-linear (fc1's
    split with its rows, fc2's whole)."""
    m = c.model
    fc1 = ffn * (2 if m.gated_linear_unit else 1)
    bias = bool(m.add_bias_linear)
    return fc1 * m.hidden_size + m.hidden_size * ffn + (fc1 if bias else 0), (m.hidden_size if bias else 0)


def expert_params(c) -> int:
    """Elements of one whole expert (weights and biases)."""
    return sum(_expert_parts(c, c.model.expert_ffn_hidden_size))


def local_expert_params(c) -> int:
    """Expert elements one GPU holds per MoE layer: E/EP experts, each sharded over ETP (fc2's
    bias whole)."""
    m, p = c.model, c.parallel
    split, whole = _expert_parts(c, m.expert_ffn_hidden_size)
    return m.num_experts // p.expert_model_parallel_size * (split // expert_tp(c) + whole)


def expert_tp(c) -> int:
    """ETP: --expert-tensor-parallel-size, TP where unset."""
    return c.parallel.expert_tensor_parallel_size or c.parallel.tensor_model_parallel_size


def expert_tokens(c) -> int:
    """Tokens of a micro-batch one rank's experts see per MoE layer, before routing: its own
    (s·b/CP, over TP under sequence parallelism) gathered over its ETP group."""
    m, p, t = c.model, c.parallel, c.parallel.tensor_model_parallel_size
    tokens = m.seq_length // p.context_parallel_size * c.training.micro_batch_size
    own = tokens // t if (p.sequence_parallel and t > 1) else tokens
    return own * expert_tp(c)


def moe_layer_params(c) -> tuple[int, int]:
    """(elements sharded over TP on one TP rank, replicated) of an MoE layer's MLP other than its
    routed experts: the shared expert (a dense MLP); the router (with its bias unless
    --disable-bias-linear) and the shared expert's gate."""
    m, t = c.model, c.parallel.tensor_model_parallel_size
    f_s, h = m.moe_shared_expert_intermediate_size or 0, m.hidden_size
    split, whole = _expert_parts(c, f_s) if f_s else (0, 0)
    router = m.num_experts * (h + (1 if m.add_bias_linear else 0))
    return split // t, whole + router + (h if f_s and m.moe_shared_expert_gate else 0)


def active_params(c, total: int) -> int:
    """Parameters a token is routed through, of a model of `total`: all but the E - k experts
    each MoE layer does not send it to."""
    if not c.model.num_experts:
        return total
    unused = (c.model.num_experts - c.model.moe_router_topk) * expert_params(c)
    return total - sum(moe_pattern(c)) * unused


def moe_mlp_activation_bytes(c) -> float:
    """Bytes an MoE layer's MLP keeps for backward per micro-batch on one rank (beside the
    layer's norms and attention), as megalite's modules keep them: the router's fp32 input and
    top-k choices (and its scores where a loss or the score function needs them); for each of the
    T·k routed rows its expert input, the expert MLP's fc1 output and activations (SwiGLU: [gate;
    up], silu(gate) and their product, as the dense MLP), the expert output and its probability
    (fp32; what the combine keeps), and the int64 indices that sort and unsort the rows; the
    shared expert as a dense MLP."""
    m, p = c.model, c.parallel
    t, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, expert_tp(c)
    a = 2 if (c.optimizer.bf16 or c.optimizer.fp16) else 4  # bytes of an activation
    h, E, k = m.hidden_size, m.num_experts, m.moe_router_topk
    tokens = m.seq_length // p.context_parallel_size * c.training.micro_batch_size  # the TP group's
    own = tokens // t if (p.sequence_parallel and t > 1) else tokens  # routed by this rank
    glu = 4 if m.gated_linear_unit else 2  # fc1's output and the activations kept, per f, in activations
    router = own * (4 * h + 12 * k) + (4 * E * h if a == 2 else 0)  # fp32 input (and weight), probs, indices
    aux = m.moe_router_load_balancing_type != "none" and m.moe_aux_loss_coeff > 0
    if aux or m.moe_router_score_function == "sigmoid" or m.moe_router_pre_softmax:
        router += own * 4 * E  # the scores
    if m.moe_z_loss_coeff:
        router += own * (4 * E + 4)  # logsumexp keeps the logits and its result
    rows = expert_tokens(c) * k  # balanced routing: as many rows arrive as leave
    indices = 5 if (p.moe_token_dispatcher_type == "alltoall" and ep > 1) else 3  # int64 vectors of rows
    experts = rows * (2 * a * h + a * glu * m.expert_ffn_hidden_size / etp + 4 + 8 * indices)
    shared = 0.0
    if m.moe_shared_expert_intermediate_size:  # fc1's (sequence-sharded) input, its activations
        shared = own * a * h + tokens * a * glu * m.moe_shared_expert_intermediate_size / t
        if m.moe_shared_expert_gate:
            shared += own * (a * h + 4)  # the shared output and the gate's sigmoid
    return router + experts + shared


def stage_dispatch_bytes(c, pp_rank: int) -> float:
    """Bytes of hidden states one GPU of stage `pp_rank` sends to other EP ranks per iteration
    (module docstring), at balanced routing."""
    m, p = c.model, c.parallel
    ep = p.expert_model_parallel_size
    if ep == 1 or not m.num_experts:
        return 0.0
    pattern = moe_pattern(c)
    layers = [n for chunk in chunk_layers(c, pp_rank) for n in chunk if pattern[n]]
    collectives = 4 * len(layers)
    if c.recompute.recompute_granularity == "full":
        collectives += 2 * len(recomputed(c, pp_rank, layers))
    tokens = expert_tokens(c)
    a = 2 if (c.optimizer.bf16 or c.optimizer.fp16) else 4
    if p.moe_token_dispatcher_type == "alltoall":
        per = tokens * m.moe_router_topk * (ep - 1) / ep
    else:
        per = tokens * (ep - 1)
    return collectives * per * m.hidden_size * a * c.training.num_microbatches


def recomputed(c, pp_rank: int, layers: list[int]) -> list[int]:
    """Of `layers` on stage `pp_rank`, those full recompute rebuilds in backward: every layer
    (uniform), or the first --recompute-num-layers of each chunk (block)."""
    if (c.recompute.recompute_method or "uniform") == "uniform":
        return layers
    k = c.recompute.recompute_num_layers or 1
    first = {n for chunk in chunk_layers(c, pp_rank) for n in chunk[:k]}
    return [n for n in layers if n in first]
