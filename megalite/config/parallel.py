"""The rank grid and the data-parallel side: parallel sizes, rank order, backend, sequence
parallelism, activation recompute, and what is sharded over data-parallel ranks."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import AT_LEAST_0, AT_LEAST_1, derived, flag, int_words, internal
from .sharding import NAMES as SHARDING_STRATEGIES
from .sharding import default_strategy_name, get_strategy

# --offload-modules (model/offload.py maps them to modules)
OFFLOAD_MODULES = ("attn_norm", "mlp_norm", "qkv_linear", "core_attn", "attn_proj", "expert_fc1", "moe_act")


@dataclass
class ParallelConfig:
    """parallelism"""
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", 1, "TP (>= 1)", check=AT_LEAST_1)
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size", 1, "PP (>= 1)", check=AT_LEAST_1)
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        "--num-layers-per-virtual-pipeline-stage", None,
        "layers per model chunk (>= 1): v = layers / (PP x this) chunks per rank (interleaved 1F1B)", type=int,
        check=AT_LEAST_1)
    pipeline_model_parallel_layout: str | None = flag(
        "--pipeline-model-parallel-layout", None, "the layers of each pipeline stage as Megatron-LM's string: E "
        "(embedding), t (transformer layer), m (MTP layer), L (loss), '|' between stages, X*N and (...)*N repeat; "
        "PP x v stages give v virtual stages per rank (stage k: virtual stage k // PP of rank k mod PP), e.g. "
        "'Ettt|ttmL' or 'E(t|)*7tL' (docs/parallelism.md)", type=str)
    # Megatron-LM's other splits of the layers over stages (arguments/pipeline_split.py makes them a layout)
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        "--num-virtual-stages-per-pipeline-rank", None, "model chunks per pipeline rank (>= 1; interleaved 1F1B), "
        "instead of --num-layers-per-virtual-pipeline-stage", type=int, check=AT_LEAST_1)
    decoder_first_pipeline_num_layers: int | None = flag(
        "--decoder-first-pipeline-num-layers", None, "transformer layers on the first pipeline rank (>= 0; the "
        "middle ranks share the rest evenly; with VPP split evenly over its chunks)", type=int, check=AT_LEAST_0)
    decoder_last_pipeline_num_layers: int | None = flag(
        "--decoder-last-pipeline-num-layers", None, "transformer layers on the last pipeline rank (>= 0)", type=int,
        check=AT_LEAST_0)
    account_for_embedding_in_pipeline_split: bool = flag(
        "--account-for-embedding-in-pipeline-split", False, "the embedding counts as a layer in the even split: the "
        "first (virtual) stage holds one transformer layer fewer", action="store_true")
    account_for_loss_in_pipeline_split: bool = flag(
        "--account-for-loss-in-pipeline-split", False, "the loss counts as a layer in the even split: the last "
        "(virtual) stage holds one transformer layer fewer", action="store_true")
    microbatch_group_size_per_vp_stage: int | None = flag(
        "--microbatch-group-size-per-virtual-pipeline-stage", None, "interleaved 1F1B: micro-batches run through "
        "one model chunk before the next (default PP, depth-first; from PP to the micro-batches of an iteration; "
        "the last group's remainder 0 or >= PP), Megatron-LM's tunable schedule", type=int, check=AT_LEAST_1)
    context_parallel_size: int = flag(
        "--context-parallel-size", 1,
        "CP (>= 1): each sequence split over this many ranks (2·CP chunks, rank r keeps chunks r and 2·CP-1-r); "
        "attention exact by --cp-comm-type; gradients reduced and ZeRO-1 sharded over DP x CP. "
        "--seq-length must divide by 2·CP (2·CP·TP with --sequence-parallel)", check=AT_LEAST_1)
    cp_comm_type: list = flag(
        "--cp-comm-type", None, "how context-parallel attention communicates: allgather (keys/values all-gathered), "
        "p2p (ring attention: key/value blocks passed around the CP ring, outputs merged by log-sum-exp), a2a "
        "(Ulysses: all-to-all from sequence- to head-sharded, whole-sequence attention, all-to-all back) or a2a+p2p "
        "(a2a within the first level of --hierarchical-context-parallel-sizes, p2p across the second); one value, "
        "or one per layer. Default allgather (Megatron-LM's default is p2p: same function, less memory; "
        "docs/parallelism.md)", type=str, nargs="+", choices=["p2p", "a2a", "allgather", "a2a+p2p"],
        default_factory=lambda: ["allgather"])
    hierarchical_context_parallel_sizes: list | None = flag(
        "--hierarchical-context-parallel-sizes", None, "the CP group as levels, e.g. '2 2' for CP 4: every 2 "
        "adjacent CP ranks form a first-level group (a2a), the CP ranks with the same place in it a second-level "
        "group (p2p); the sizes multiply to --context-parallel-size (used by --cp-comm-type a2a+p2p); one quoted "
        "argument '2 2' is read as two", type=int_words, nargs="+")
    expert_model_parallel_size: int = flag(
        "--expert-model-parallel-size", 1, "EP (>= 1): each MoE layer's experts split over this many ranks, taken "
        "from the DP x CP ranks (which must divide by it); expert weights are data-parallel over the remaining "
        "DP x CP / EP ranks", check=AT_LEAST_1)
    expert_tensor_parallel_size: int | None = flag(
        "--expert-tensor-parallel-size", None, "ETP (>= 1): each MoE expert's MLP split over this many ranks, as TP "
        "splits the dense layers (default: TP). ETP 1 keeps experts whole while attention and dense MLPs are split "
        "over TP: no expert-TP all-gather or reduce-scatter, each TP rank's tokens go to their experts on their own, "
        "and the freed ranks can serve EP (Megatron-LM's expert grid: ETP x EP x expert-DP x PP = world)",
        type=int, check=AT_LEAST_1)
    moe_token_dispatcher_type: str = flag(
        "--moe-token-dispatcher-type", "allgather", "how tokens reach their experts across EP ranks: allgather "
        "(every rank sees the EP group's tokens) or alltoall (each token sent to its experts' ranks only); flex "
        "(Megatron-LM's DeepEP / HybridEP kernels) runs alltoall, with a notice", choices=["allgather", "alltoall", "flex"])
    # a name of pipeline_parallel/schedules.py's SCHEDULES (checked by validation; torch-free here)
    pipeline_schedule: str | None = flag(
        "--pipeline-schedule", None, "the pipeline schedule by name: no_pipelining (PP 1), 1f1b (one model chunk "
        "per rank), interleaved_1f1b (--num-layers-per-virtual-pipeline-stage), zb_h1 (zero bubble ZB-H1: 1F1B's "
        "memory, weight gradients fill the bubble), zbv (ZB-V: 2 chunks per rank in a V, rank 0 holding the first "
        "and the last; --num-layers-per-virtual-pipeline-stage num-layers / (2 x PP) unless given); both split "
        "each backward (--delay-wgrad-compute) and run on gloo; default: the one the layout implies", type=str)
    delay_wgrad_compute: bool = flag(
        "--delay-wgrad-compute", False, "split each backward into the input gradient (B) and the weight gradient "
        "(W), computed later from the kept input and output gradient, for a schedule to place W where the pipeline "
        "would idle: on with --pipeline-schedule zb_h1 or zbv (which need it); without them refused (Megatron-LM "
        "uses it to overlap --overlap-moe-expert-parallel-comm's all-to-alls, which megalite has not)",
        action="store_true")
    num_distributed_optimizer_instances: int = flag(
        "--num-distributed-optimizer-instances", 1, "(>= 1) with a sharded strategy: the data-parallel (x CP) ranks "
        "cut into this many instances of consecutive ranks, the optimizer state (and the sharded gradients and "
        "parameters) sharded within each instance and replicated across them: gradients reduce-scattered within "
        "the instance, then all-reduced across instances (Megatron-LM's partial distributed optimizer; with "
        "--use-megatron-fsdp, HSDP); likewise an expert's expert-DP ranks", check=AT_LEAST_1)
    use_tp_pp_dp_mapping: bool = flag("--use-tp-pp-dp-mapping", False,
                                      "rank order TP-CP-PP-DP instead of Megatron's default TP-CP-DP-PP",
                                      action="store_true")
    sequence_parallel: bool = flag("--sequence-parallel", False,
                                   "shard activations outside the tensor-parallel regions along the sequence "
                                   "(needs --tensor-model-parallel-size > 1)", action="store_true")
    distributed_backend: str | None = flag("--distributed-backend", None, "default: nccl with CUDA, gloo without",
                                           choices=["nccl", "gloo"])
    distributed_timeout_minutes: float = flag(
        "--distributed-timeout-minutes", 10.0,
        "timeout of every collective and of start-up (fractions allowed, e.g. 0.5); when it fires, every rank "
        "still running dumps its Python stacks and the error names the collective, its group, the iteration and "
        "the pipeline stage", check=(lambda v: v == v and 0 < v < float("inf"), "a number > 0 (fractions allowed)"))
    fake_process_group: bool = flag(
        "--fake-process-group", False, "a fake process group of $WORLD_SIZE ranks in which this one process is rank "
        "$RANK: every collective completes at once without communicating (Megatron-LM's; with --dry-run, one rank "
        "of a large layout built and stepped on one CPU)", action="store_true")
    world_size: int = derived(1, "WORLD_SIZE at validation")
    data_parallel_size: int = derived(1, "world / (TP x PP x CP)")
    expert_data_parallel_size: int = derived(1, "world / (ETP x EP x PP): the replicas of each expert")
    virtual_pipeline_model_parallel_size: int = derived(1, "layers / (PP x --num-layers-per-virtual-pipeline-stage)")
    rank_order: str = derived("tp-cp-dp-pp", "from --use-tp-pp-dp-mapping")


@dataclass
class RecomputeConfig:
    """activation recompute"""
    recompute_granularity: str | None = flag(
        "--recompute-granularity", None, "activation recompute: 'full' recomputes whole transformer layers (with "
        "--recompute-method and --recompute-num-layers), 'selective' only core attention",
        choices=["full", "selective"])
    recompute_method: str | None = flag(
        "--recompute-method", None, "with full recompute: 'uniform' keeps the input of every chunk of "
        "--recompute-num-layers layers and recomputes the chunk; 'block' recomputes the first "
        "--recompute-num-layers layers of each pipeline stage (model chunk) and keeps the rest",
        choices=["uniform", "block"])
    recompute_num_layers: int | None = flag(
        "--recompute-num-layers", None, "layers per recomputed chunk (uniform) or recomputed layers per stage "
        "(block); from 1 to the layers per stage", type=int)
    recompute_modules: list = flag(
        "--recompute-modules", None, "with --recompute-granularity selective: the parts of each layer recomputed in "
        "backward: core_attn (the default), layernorm (both norms), mlp (a dense MLP), moe (an MoE layer), "
        "shared_experts, moe_act (the experts' activation), mla_up_proj (MLA's up projections and RoPE)",
        type=str, nargs="+", default_factory=lambda: ["core_attn"])
    fine_grained_activation_offloading: bool = flag(
        "--fine-grained-activation-offloading", False, "keep what the --offload-modules parts of each layer save for "
        "backward in host memory (on an accelerator; on the CPU it is there already)", action="store_true")
    offload_modules: list = flag(
        "--offload-modules", None, "with --fine-grained-activation-offloading: the parts whose saved activations "
        "move to host memory (expert_fc1 and moe_act: the routed experts whole)", type=str, nargs="+",
        choices=OFFLOAD_MODULES, default_factory=list)
    recompute_activations: bool = flag("--recompute-activations", False,
                                       "shorthand for --recompute-granularity selective", action="store_true")

    def check(self) -> None:
        """For configs built in code (validation checks the flags with their names first)."""
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', "
                             f"got {self.recompute_granularity!r}")
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ValueError(f"full recompute needs recompute_method 'uniform' or 'block', "
                                 f"got {self.recompute_method!r}")
            if not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 1:
                raise ValueError(f"full recompute needs recompute_num_layers >= 1, got {self.recompute_num_layers!r}")
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ValueError("recompute_method and recompute_num_layers apply to recompute_granularity 'full' only")


@dataclass
class DDPConfig:
    """distributed optimizer: what is sharded over DP (Megatron-LM's --data-parallel-sharding-strategy:
    no_shard; optim = ZeRO-1 = --use-distributed-optimizer; optim_grads = ZeRO-2; optim_grads_params =
    ZeRO-3), bucketed reductions and gathers"""
    data_parallel_sharding_strategy: str | None = flag(
        "--data-parallel-sharding-strategy", None,
        "what is sharded over data-parallel ranks: nothing; the optimizer state (ZeRO-1); and the gradients "
        "(ZeRO-2); and the parameters, gathered per layer for forward and backward (ZeRO-3). Default: optim with "
        "--use-distributed-optimizer, else no_shard", choices=SHARDING_STRATEGIES)
    use_distributed_optimizer: bool = flag(
        "--use-distributed-optimizer", False, "ZeRO-1: shard fp32 master weights and optimizer state over "
        "data-parallel ranks (= --data-parallel-sharding-strategy optim)", action="store_true")
    overlap_grad_reduce: bool = flag("--overlap-grad-reduce", False, "start each bucket's DP gradient reduction "
                                     "during backward, as soon as it is complete", action="store_true")
    overlap_param_gather: bool = flag(
        "--overlap-param-gather", False, "with a sharded strategy: all-gather each bucket's parameters during the "
        "next forward, just before they are used (ZeRO-3: prefetch the next layer's gather)", action="store_true")
    ddp_bucket_size: int = flag("--ddp-bucket-size", 40_000_000, "elements per gradient all-reduce bucket (>= 1)",
                                check=AT_LEAST_1)
    # Megatron-LM's FSDP flags, run on megalite's sharded strategies (arguments/fsdp.py)
    use_megatron_fsdp: bool = flag(
        "--use-megatron-fsdp", False, "Megatron FSDP: runs as megalite's --data-parallel-sharding-strategy "
        "(optim_grads_params, ZeRO-3, unless given; Megatron-LM's default for it), with its dtype flags below",
        action="store_true")
    use_torch_fsdp2: bool = flag("--use-torch-fsdp2", False, "PyTorch FSDP2 (fully sharded): runs as megalite's "
                                 "ZeRO-3 (optim_grads_params)", action="store_true")
    megatron_fsdp_main_params_dtype: str = flag(
        "--megatron-fsdp-main-params-dtype", "fp32", "--use-megatron-fsdp: the masters' dtype (auto: the "
        "parameters'); megalite's --main-params-dtype", choices=["fp32", "bf16", "fp16", "auto"])
    megatron_fsdp_main_grads_dtype: str = flag(
        "--megatron-fsdp-main-grads-dtype", "auto", "--use-megatron-fsdp: the dtype gradients accumulate in (auto: "
        "the parameters'; bf16 is megalite's --grad-reduce-in-bf16)", choices=["fp32", "bf16", "fp16", "auto"])
    megatron_fsdp_grad_comm_dtype: str = flag(
        "--megatron-fsdp-grad-comm-dtype", "auto", "--use-megatron-fsdp: the dtype gradients are reduced in (auto: "
        "the main gradients'; megalite reduces in the dtype it accumulates in)", choices=["fp32", "fp16", "bf16", "auto"])
    outer_dp_sharding_strategy: str = flag(
        "--outer-dp-sharding-strategy", "no_shard", "--use-megatron-fsdp with --num-distributed-optimizer-instances "
        "(HSDP): no_shard replicates across the instances (optim, sharding the optimizer across them too, is not "
        "built)", choices=["no_shard", "optim"])
    ddp_average_in_collective: bool = flag(
        "--ddp-average-in-collective", False, "Megatron-LM divides by DP inside the reduction instead of before it "
        "(megalite's gradients are divided before their sum: a notice; the same function)", action="store_true")
    grad_reduce_in_bf16: bool = flag(
        "--grad-reduce-in-bf16", False, "with --bf16: accumulate and data-parallel-reduce gradients in bf16 instead "
        "of fp32 (half the gradient memory and traffic; the fp32 master weights stay)", action="store_true")
    gradient_accumulation_fusion: bool = flag(
        "--no-gradient-accumulation-fusion", True, "Megatron-LM's gradient-accumulation fusion off: by default the "
        "linear layers' weight-gradient GEMMs write into the gradient buffer (ZeRO-2/3: its staging buffer; fp32 "
        "from 16-bit weights on CUDA) instead of a .grad copied or added there; not under --compile, for FP8 "
        "layers or in the experts' grouped GEMM (tensor_parallel/grad_fusion.py)", action="store_false")
    # Measured alternatives (benchmarks/RESULTS_zero.md), not flags: the defaults won.
    reduce_grads_every_microbatch: bool = internal(
        True, "ZeRO-2/3 with several micro-batches: reduce-scatter every micro-batch's gradients (True), or "
        "accumulate the step's gradients in a full-size fp32 buffer and reduce once (False)")
    keep_params_gathered_in_step: bool = internal(
        False, "ZeRO-3: free gathered parameters after each use (False), or keep them gathered from their first "
        "use in a step until the last micro-batch's backward (True)")

    def __post_init__(self):
        if self.data_parallel_sharding_strategy is None:
            self.data_parallel_sharding_strategy = default_strategy_name(self.use_distributed_optimizer)
        if get_strategy(self.data_parallel_sharding_strategy).shards_optimizer:
            self.use_distributed_optimizer = True  # (no_shard with it is refused by validation, naming both)
