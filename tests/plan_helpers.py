"""What the planner's exact parameter counts are checked against: the model megalite builds, stage
by stage (tests of planning/memory.py's stage_params and total_params)."""
from megalite.model import GPTModel
from megalite.parallel_state import stage_layers
from megalite.tensor_parallel.param_info import param_info


def built_stage_params(c) -> tuple[list[int], int]:
    """For the planner's config `c`: the parameters each pipeline stage builds (every virtual chunk
    of it, on the meta device, with --pipeline-model-parallel-layout where given), and the whole
    model's once (a tied embedding's last-stage copy left out)."""
    config, p = c.model, c.parallel
    pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    built, once = [], 0
    for r in range(pp):
        n = 0
        for k, (offset, layers) in enumerate(stage_layers(config.num_layers, pp, v, r,
                                                          p.pipeline_model_parallel_layout)):
            chunk = GPTModel(config, None, None, pre_process=r == 0 and k == 0, post_process=r == pp - 1 and k == v - 1,
                             layer_offset=offset, num_layers=layers, device="meta")
            n += sum(t.numel() for t in chunk.parameters())
            once += sum(t.numel() for t in chunk.parameters() if not param_info(t).tied_copy)
        built.append(n)
    return built, once
