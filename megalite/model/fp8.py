"""Which linear layers of a model compute in FP8 (--fp8-format), and the FP8 sites that say how
(megalite/fp8/site.py), attached to the modules once the model is built.

In FP8: the transformer layers' linears (QKV and output projections, MLA's projections, the MLP's
fc1 and fc2, the shared expert's) and the routed experts (model/moe/fp8_experts.py); with
--first-last-layers-bf16 the first --num-layers-at-start-in-bf16 and last
--num-layers-at-end-in-bf16 decoder layers stay out (global layer numbers, Megatron-LM's
is_first_last_bf16_layer), and multi-token prediction is in FP8 whenever FP8 is on (Megatron-LM's
MTP block takes the global FP8 context). Out of FP8, as in Megatron-LM with Transformer Engine:
the embedding, the output layer (its --fp8-output-proj is mxfp8's), the router, norms and the
attention itself."""
from __future__ import annotations

from .. import comm
from ..config.fp8 import FP8Config
from ..fp8 import backend
from ..fp8.blockwise import Axis
from ..fp8.context import FP8Context
from ..fp8.recipe import Recipe
from ..fp8.site import GemmSite, Groups
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.param_info import param_info
from .mla import ReplicatedLinear
from .moe.experts import LocalExperts
from .moe.fp8_experts import ExpertsFP8


def attach_fp8(chunks: list, config: FP8Config, ps, device) -> FP8Context | None:
    """Give this rank's FP8 linears their sites; None when FP8 is off. The sites are made in
    module order, the same on every rank of a pipeline stage (delayed scaling's slots)."""
    if not config.enabled:
        return None
    recipe = Recipe.from_config(config, emulate=not backend.has_fp8_gemm(device))
    context = FP8Context(recipe, reduce_groups=(ps.tp_group, ps.dp_cp_group))
    for chunk in chunks:
        num_layers = chunk.config.num_layers
        roots = [layer for layer in chunk.decoder.layers if config.layer_in_fp8(layer.layer_number, num_layers)]
        roots += [chunk.mtp] if chunk.mtp is not None else []
        for root in roots:
            for name, module in root.named_modules():
                site = _site(module, context, ps, chunk.execution.sequence_parallel, device, name)
                if site is not None:
                    module.fp8 = site
                    context.register(site)
    context.materialize(device)
    return context


def _split_axis(weight, dim: int, group, device) -> Axis:
    """The axis of `weight` along `dim` as the whole tensor has it (tensor_parallel split)."""
    info = param_info(weight)
    local = weight.shape[dim]
    if not info.tensor_parallel or info.partition_dim != dim:
        return Axis(local)
    rank, size = info.tp_place(comm.group_rank(group), comm.group_size(group))
    return Axis.split(local, rank, size, info.partition_stride, group, device)


def _site(module, context: FP8Context, ps, sequence_parallel: bool, device, name: str):
    tp, cp = ps.tp_group, ps.cp_group
    if isinstance(module, ColumnParallelLinear):
        w = module.weight
        return GemmSite(context, Groups(tokens=(cp,), out_split=tp), w, out_axis=_split_axis(w, 0, tp, device),
                        name=name)
    if isinstance(module, RowParallelLinear):
        w = module.weight
        return GemmSite(context, Groups(tokens=(cp,), in_split=tp), w, in_axis=_split_axis(w, 1, tp, device),
                        name=name)
    if isinstance(module, ReplicatedLinear):  # sequence-sharded input under SP
        return GemmSite(context, Groups(tokens=(cp, tp) if sequence_parallel else (cp,)), module.weight, name=name)
    if isinstance(module, LocalExperts):
        first = next(iter(module.local_experts.values()))
        group = module.etp_group
        axes = {"linear_fc1": (Axis(first.linear_fc1.weight.shape[1]), _split_axis(first.linear_fc1.weight, 0, group,
                                                                                  device)),
                "linear_fc2": (_split_axis(first.linear_fc2.weight, 1, group, device),
                               Axis(first.linear_fc2.weight.shape[0]))}
        return ExpertsFP8(context, module, ps, axes, name)
    return None


__all__ = ["attach_fp8"]
