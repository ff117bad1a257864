"""Megatron-LM's FSDP flags and partial distributed optimizer on megalite's sharding strategies:
--use-megatron-fsdp (and its dtype flags, HSDP's --outer-dp-sharding-strategy), --use-torch-fsdp2,
--num-distributed-optimizer-instances. Megatron FSDP and FSDP2 shard what megalite's
--data-parallel-sharding-strategy names (optim_grads_params: ZeRO-3), so they run as it."""
from __future__ import annotations

from ..config.run import RunConfig
from ..config.sharding import get_strategy
from .errors import fail

FSDP_DTYPES = ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype")


def check_fsdp(c: RunConfig) -> None:
    """Before the precision checks: the FSDP flags set the strategy and the dtypes they name."""
    d = c.ddp
    if d.use_megatron_fsdp and d.use_torch_fsdp2:
        fail("--use-megatron-fsdp and --use-torch-fsdp2 are two FSDP implementations: give one (Megatron-LM: "
             "'Cannot use both')")
    if d.use_torch_fsdp2:
        _torch_fsdp2(c)
    if d.use_megatron_fsdp:
        _megatron_fsdp(c)
    else:
        given = [f for f in FSDP_DTYPES if f"ddp.{f}" in c.explicit]
        if given or d.outer_dp_sharding_strategy != "no_shard":
            name = "--" + (given[0] if given else "outer_dp_sharding_strategy").replace("_", "-")
            c.notices.append(f"{name} has no effect without --use-megatron-fsdp (Megatron-LM accepts and ignores it "
                             "there)")
    _instances(c)
    if d.ddp_average_in_collective:
        c.notices.append("--ddp-average-in-collective: Megatron-LM divides by DP inside the reduction; megalite's "
                         "gradients are divided before their sum (the same function)")


def _torch_fsdp2(c: RunConfig) -> None:
    """FSDP2 shards parameters, gradients and optimizer state: ZeRO-3. Megatron-LM's limits on its
    FSDP2 (no PP, EP or fp16; untied embeddings) are its implementation's: megalite's ZeRO-3 runs
    those, so they are not carried over."""
    _zero3(c, "--use-torch-fsdp2 (PyTorch FSDP2, fully sharded)")


def _zero3(c: RunConfig, what: str) -> None:
    d = c.ddp
    if "ddp.data_parallel_sharding_strategy" not in c.explicit:
        d.data_parallel_sharding_strategy = "optim_grads_params"
    d.use_distributed_optimizer = get_strategy(d.data_parallel_sharding_strategy).shards_optimizer
    c.notices.append(f"{what} runs as megalite's --data-parallel-sharding-strategy "
                     f"{d.data_parallel_sharding_strategy} (the same sharding; per-layer gathers on use)")


def _megatron_fsdp(c: RunConfig) -> None:
    """Megatron FSDP's strategy (its --data-parallel-sharding-strategy, default optim_grads_params)
    and dtypes: main params fp32 (megalite's masters), or 16-bit (the precision-aware optimizer's
    --main-params-dtype); main gradients in the parameters' dtype by default (auto: bf16 is
    --grad-reduce-in-bf16), reduced in that dtype."""
    d, o = c.ddp, c.optimizer
    _zero3(c, "--use-megatron-fsdp (Megatron FSDP)")
    params = "bf16" if o.bf16 else "fp16" if o.fp16 else "fp32"
    main_params = params if d.megatron_fsdp_main_params_dtype == "auto" else d.megatron_fsdp_main_params_dtype
    if main_params != "fp32":
        if params == "fp32":
            fail(f"--megatron-fsdp-main-params-dtype {main_params} needs --bf16 or --fp16: fp32 parameters are their "
                 "own master weights")
        o.use_precision_aware_optimizer, o.main_params_dtype = True, main_params
    grads = params if d.megatron_fsdp_main_grads_dtype == "auto" else d.megatron_fsdp_main_grads_dtype
    comm = grads if d.megatron_fsdp_grad_comm_dtype == "auto" else d.megatron_fsdp_grad_comm_dtype
    if comm != grads:
        fail(f"--megatron-fsdp-grad-comm-dtype {comm} with main gradients in {grads} is not supported: megalite "
             "reduces gradients in the dtype they accumulate in")
    if grads == "fp16":
        fail("--megatron-fsdp-main-grads-dtype fp16 is not supported: megalite accumulates gradients in fp32 or bf16")
    if grads == "bf16":
        if params != "bf16":
            fail("--megatron-fsdp-main-grads-dtype bf16 needs --bf16 (megalite's --grad-reduce-in-bf16)")
        d.grad_reduce_in_bf16 = True
    elif d.grad_reduce_in_bf16:
        fail("--grad-reduce-in-bf16 contradicts --megatron-fsdp-main-grads-dtype fp32: give one")
    if d.outer_dp_sharding_strategy == "optim":
        fail("--outer-dp-sharding-strategy optim is not supported: sharding the optimizer state across HSDP's "
             "instances as well is not built (no_shard replicates it, Megatron-LM's default)")


def _instances(c: RunConfig) -> None:
    """--num-distributed-optimizer-instances: a sharded strategy, and instances that divide the
    replica groups (DP x CP; an expert's expert-DP group)."""
    n, d, p = c.parallel.num_distributed_optimizer_instances, c.ddp, c.parallel
    if n == 1:
        return
    if not get_strategy(d.data_parallel_sharding_strategy).shards_optimizer:
        fail(f"--num-distributed-optimizer-instances {n} needs a sharded strategy (--use-distributed-optimizer, "
             "--use-megatron-fsdp or --data-parallel-sharding-strategy optim...; Megatron-LM asserts it)")
    dp_cp = p.data_parallel_size * p.context_parallel_size
    if dp_cp % n:
        fail(f"--num-distributed-optimizer-instances {n} does not divide the data-parallel x context-parallel ranks "
             f"({dp_cp})")
    if p.expert_data_parallel_size % n and c.model.num_experts:
        fail(f"--num-distributed-optimizer-instances {n} does not divide the expert-data-parallel ranks "
             f"({p.expert_data_parallel_size})")
