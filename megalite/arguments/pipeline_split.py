"""Megatron-LM's other ways to split the layers over pipeline stages, as the stage layout they
imply (--pipeline-model-parallel-layout, config/pipeline_layout.py):

  --num-virtual-stages-per-pipeline-rank v       v model chunks per rank (VPP = v)
  --decoder-first-pipeline-num-layers F          the first pipeline rank holds F layers, the last
  --decoder-last-pipeline-num-layers L           L, the others share the rest evenly; with VPP each
                                                 rank's layers split evenly over its chunks
  --account-for-embedding-in-pipeline-split      the embedding (the loss) counts as a layer in the
  --account-for-loss-in-pipeline-split           even split: the first (last) virtual stage holds
                                                 one transformer layer fewer

as Megatron-LM's get_num_layers_to_build and get_transformer_layer_offset count them."""
from __future__ import annotations

from ..config.run import RunConfig
from .errors import fail


def apply_pipeline_split(c: RunConfig) -> None:
    """Turn the flags above into VPP or a stage layout (before the layout is checked)."""
    p, m = c.parallel, c.model
    pp, layers = p.pipeline_model_parallel_size, m.num_layers
    v_stages = p.num_virtual_stages_per_pipeline_rank
    uneven = p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None
    account = p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split
    ways = [name for name, given in (("--num-layers-per-virtual-pipeline-stage",
                                      p.num_layers_per_virtual_pipeline_stage is not None),
                                     ("--num-virtual-stages-per-pipeline-rank", v_stages is not None),
                                     ("--pipeline-model-parallel-layout", p.pipeline_model_parallel_layout is not None))
            if given]
    if len(ways) > 1:
        fail(f"{ways[0]} and {ways[1]} both set the virtual stages: give one (Megatron-LM refuses both)")
    if not (uneven or account or v_stages is not None):
        return
    if p.pipeline_model_parallel_layout is not None:
        fail("--pipeline-model-parallel-layout places every layer itself: drop --decoder-first/last-pipeline-num-layers "
             "and --account-for-embedding/loss-in-pipeline-split")
    if uneven and account:
        fail("--decoder-first/last-pipeline-num-layers cannot be combined with --account-for-embedding/loss-in-"
             "pipeline-split (Megatron-LM refuses them together)")
    if uneven and p.num_layers_per_virtual_pipeline_stage is not None:
        fail("with --decoder-first/last-pipeline-num-layers give the virtual stages as "
             "--num-virtual-stages-per-pipeline-rank (Megatron-LM's rule)")
    if pp == 1:
        if v_stages not in (None, 1):
            fail("--num-virtual-stages-per-pipeline-rank needs --pipeline-model-parallel-size >= 2")
        return  # one stage holds everything: nothing to split
    if not (uneven or account):  # an even split in v chunks per rank
        if layers % (pp * v_stages):
            fail(f"--num-layers ({layers}) is not divisible by --pipeline-model-parallel-size ({pp}) x "
                 f"--num-virtual-stages-per-pipeline-rank ({v_stages})")
        p.num_layers_per_virtual_pipeline_stage = layers // (pp * v_stages) if v_stages > 1 else None
        return
    e, l = int(p.account_for_embedding_in_pipeline_split), int(p.account_for_loss_in_pipeline_split)
    total = layers + e + l
    v = v_stages or 1
    if p.num_layers_per_virtual_pipeline_stage is not None:
        k = p.num_layers_per_virtual_pipeline_stage
        if total % pp or (total // pp) % k:
            fail(f"--num-layers ({layers}){' + 1 for the embedding' if e else ''}{' + 1 for the loss' if l else ''} "
                 f"over --pipeline-model-parallel-size ({pp}) is not a multiple of --num-layers-per-virtual-"
                 f"pipeline-stage ({k}) per stage")
        v = total // pp // k
        p.num_layers_per_virtual_pipeline_stage = None
    counts = _uneven_counts(c, v) if uneven else _even_counts(c, v, e, l)
    p.pipeline_model_parallel_layout = _layout(counts, m.mtp_num_layers or 0)


def _even_counts(c: RunConfig, v: int, e: int, l: int) -> list[int]:
    """Transformer layers per stage (stage k = chunk k // PP of rank k % PP): the layers plus the
    embedding and loss split evenly, then the first (last) stage one fewer for each."""
    pp, layers = c.parallel.pipeline_model_parallel_size, c.model.num_layers
    total = layers + e + l
    if total % (pp * v):
        fail(f"--num-layers ({layers}){' + 1 for the embedding' if e else ''}{' + 1 for the loss' if l else ''} "
             f"= {total} is not divisible by --pipeline-model-parallel-size ({pp}) x virtual stages ({v})")
    counts = [total // (pp * v)] * (pp * v)
    counts[0] -= e
    counts[-1] -= l
    if min(counts) < 0:
        fail("not enough layers for the embedding (loss) to take a layer's place in the first (last) stage")
    return counts


def _uneven_counts(c: RunConfig, v: int) -> list[int]:
    """--decoder-first/last-pipeline-num-layers: the first and last ranks' layers as given, the
    middle ranks' the rest in equal parts; each rank's split evenly over its v chunks."""
    p, layers = c.parallel, c.model.num_layers
    pp, first, last = p.pipeline_model_parallel_size, p.decoder_first_pipeline_num_layers, \
        p.decoder_last_pipeline_num_layers
    rest, middle = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        fail(f"--decoder-first/last-pipeline-num-layers ({first}, {last}) leave {rest} of the --num-layers "
             f"({layers}) for {middle} middle pipeline stage(s): they must divide evenly")
    per_rank = [rest // middle if middle else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    for r, n in enumerate(per_rank):
        if n % v:
            fail(f"pipeline rank {r}'s {n} layers do not split over --num-virtual-stages-per-pipeline-rank ({v}) "
                 "chunks evenly")
    return [per_rank[k % pp] // v for k in range(pp * v)]


def _layout(counts: list[int], mtp: int) -> str:
    stages = ["t" * n for n in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp + "L"
    return "|".join(stages)
