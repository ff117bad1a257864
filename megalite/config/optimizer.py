"""The update: optimizer, learning-rate schedule, mixed precision and loss scaling, offload."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import AT_LEAST_1, IN_0_1, NON_NEGATIVE, POSITIVE, at_least_0, derived, flag

_FP16 = "--fp16: "


@dataclass
class OptimizerConfig:
    """optimizer, learning rate and mixed precision"""
    optimizer: str = flag("--optimizer", "adam", "adam (AdamW), sgd, or muon (Muon for the transformer layers' "
                          "matrices, --muon-scalar-optimizer for the rest; docs/optimizers.md)",
                          choices=["adam", "sgd", "muon"])
    lr: float = flag("--lr", 1e-4, "peak learning rate (> 0; required)", check=POSITIVE, required=True)
    min_lr: float = flag("--min-lr", 0.0, "learning rate at the end of decay (>= 0, <= --lr)", check=NON_NEGATIVE)
    weight_decay: float = flag("--weight-decay", 0.01, "decoupled weight decay (>= 0)", check=NON_NEGATIVE)
    apply_wd_to_qk_layernorm: bool = flag(
        "--apply-wd-to-qk-layernorm", False, "weight decay on the query/key norms' weights too (Qwen3-Next's; "
        "Megatron-LM's rule otherwise leaves every 1-D parameter and bias undecayed)", action="store_true")
    adam_beta1: float = flag("--adam-beta1", 0.9, "in [0, 1)", check=IN_0_1)
    adam_beta2: float = flag("--adam-beta2", 0.999, "in [0, 1)", check=IN_0_1)
    adam_eps: float = flag("--adam-eps", 1e-8, "> 0", check=POSITIVE)
    sgd_momentum: float = flag("--sgd-momentum", 0.9, "in [0, 1)", check=IN_0_1)
    # Muon (Jordan et al. 2024; Liu et al. 2025, Moonlight): momentum orthogonalized by Newton-Schulz
    muon_momentum: float = flag("--muon-momentum", 0.95, "Muon's momentum beta, in [0, 1)", check=IN_0_1)
    muon_nesterov: bool = flag("--muon-nesterov", False, "Muon: Nesterov momentum (the update is g lerp'd toward "
                               "the momentum by beta)", action="store_true")
    muon_split_qkv: bool = flag("--muon-no-split-qkv", True, "Muon: orthogonalize the fused QKV weight as one "
                                "matrix instead of Q, K and V each on their own", action="store_false")
    muon_num_ns_steps: int = flag("--muon-num-ns-steps", 5, "Muon: Newton-Schulz iterations (>= 1)", check=AT_LEAST_1)
    muon_scale_mode: str = flag("--muon-scale-mode", "spectral", "Muon: scale of the orthogonalized update of an "
                                "[out, in] matrix: spectral sqrt(max(out, in)), unit_rms_norm sqrt(out/in), "
                                "shape_scaling sqrt(max(1, out/in))",
                                choices=["spectral", "unit_rms_norm", "shape_scaling"])
    muon_extra_scale_factor: float = flag("--muon-extra-scale-factor", 1.0, "Muon: extra factor on the update "
                                          "(> 0; 0.2 with spectral matches AdamW's update RMS, Moonlight)",
                                          check=POSITIVE)
    muon_tp_mode: str = flag("--muon-tp-mode", "blockwise", "Muon under tensor parallelism: blockwise "
                             "orthogonalizes each TP shard (no traffic; the update depends on the TP size), "
                             "duplicated all-gathers the matrix and every TP rank orthogonalizes it whole, "
                             "distributed runs Newton-Schulz on the shards with an all-reduce per iteration",
                             choices=["blockwise", "duplicated", "distributed"])
    muon_scalar_optimizer: str = flag("--muon-scalar-optimizer", "adam", "with --optimizer muon: the optimizer of "
                                      "embeddings, output layer, norms and biases", choices=["adam", "lion"])
    lion_beta1: float = flag("--lion-beta1", 0.9, "Lion's interpolation beta of the update sign, in [0, 1)",
                             check=IN_0_1)
    lion_beta2: float = flag("--lion-beta2", 0.99, "Lion's momentum beta, in [0, 1)", check=IN_0_1)
    # the fused QKV weight's groups, for --muon-no-split-qkv's default (Q, K, V each on their own)
    num_attention_heads: int | None = derived(None, copy_of="model.num_attention_heads")
    num_query_groups: int | None = derived(None, copy_of="model.num_query_groups")
    kv_channels: int | None = derived(None, copy_of="model.kv_channels")
    log_num_zeros_in_grad: bool = flag(
        "--log-num-zeros-in-grad", False, "add the number of zero elements in the gradients each step applies (after "
        "the data-parallel reduction, each element counted once whatever the sharding) to the log line and record "
        "(Megatron-LM's; zeros mark unused embedding rows and dead units)", action="store_true")
    clip_grad: float = flag("--clip-grad", 1.0, "global gradient-norm clip (>= 0; 0: off)",
                            check=(NON_NEGATIVE[0], "a number >= 0 (0: no clipping)"))
    fused_optimizer: bool = flag("--no-fused-optimizer", True,
                                 "use the unfused torch.optim update instead of torch's fused AdamW / SGD, which is "
                                 "the default where the device has it", action="store_false")
    # ZeRO-Offload (Ren et al. 2021): this fraction of the rank's fp32 masters and Adam moments
    # lives in host memory and is stepped there
    optimizer_cpu_offload: bool = flag(
        "--optimizer-cpu-offload", False, "keep fp32 master weights and optimizer state (a fraction of them: "
        "--optimizer-offload-fraction) in host memory and step them on the CPU; needs a sharded strategy",
        action="store_true")
    optimizer_offload_fraction: float = flag(
        "--optimizer-offload-fraction", 1.0, "with --optimizer-cpu-offload: fraction of each rank's optimizer state "
        "offloaded, in (0, 1]")
    # the learning-rate schedule, given in iterations or samples; validation converts it to samples
    lr_decay_style: str = flag("--lr-decay-style", "linear", choices=["constant", "linear", "cosine", "WSD"])
    lr_decay_iters: int | None = flag("--lr-decay-iters", None,
                                      "iterations of warmup + decay (>= 1; default --train-iters)", type=int,
                                      check=AT_LEAST_1)
    lr_decay_samples: int | None = flag("--lr-decay-samples", None, "with --train-samples: samples of warmup + decay "
                                        "(>= 1; default --train-samples)", type=int, check=AT_LEAST_1)
    lr_warmup_iters: int = flag("--lr-warmup-iters", 0, "warmup iterations (>= 0; 0: no warmup)",
                                check=at_least_0("0: no warmup"))
    lr_warmup_samples: float = flag("--lr-warmup-samples", 0, "with --train-samples: warmup samples (>= 0; 0: no "
                                    "warmup)", type=int, check=at_least_0("0: no warmup"))
    lr_warmup_fraction: float | None = flag("--lr-warmup-fraction", None, "warmup as a fraction of --lr-decay-iters "
                                            "/ --lr-decay-samples, in [0, 1]", type=float,
                                            check=(lambda v: 0 <= v <= 1, "in [0, 1]"))
    lr_warmup_init: float = flag("--lr-warmup-init", 0.0, "learning rate at the start of warmup (>= 0)",
                                 check=NON_NEGATIVE)
    lr_wsd_decay_iters: int | None = flag("--lr-wsd-decay-iters", None, "WSD: length of the final decay phase "
                                          "(>= 1, <= --lr-decay-iters)", type=int, check=AT_LEAST_1)
    lr_wsd_decay_samples: int | None = flag("--lr-wsd-decay-samples", None, "WSD with --train-samples: samples of "
                                            "the final decay phase (>= 1, <= --lr-decay-samples)", type=int,
                                            check=AT_LEAST_1)
    lr_wsd_decay_style: str = flag("--lr-wsd-decay-style", "exponential", "WSD: shape of the final decay",
                                   choices=["linear", "cosine", "exponential", "minus_sqrt"])
    # --decoupled-lr / --decoupled-min-lr: peak and minimum of the embedding and output layer
    decoupled_lr: float | None = flag("--decoupled-lr", None, "peak learning rate of the word embedding and output "
                                      "layer (> 0); they follow the schedule of --lr with this peak", type=float,
                                      check=POSITIVE)
    decoupled_min_lr: float | None = flag("--decoupled-min-lr", None, "with --decoupled-lr: their minimum learning "
                                          "rate (>= 0; default --min-lr)", type=float, check=NON_NEGATIVE)
    global_batch_size: int = derived(1, "converts the iteration count of schedules saved before samples",
                                     copy_of="training.global_batch_size")
    # mixed precision; loss scaling: --loss-scale (constant) or --fp16 (dynamic)
    bf16: bool = flag("--bf16", False, "bf16 parameters and activations, fp32 grads and master weights",
                      action="store_true")
    fp16: bool = flag("--fp16", False, "fp16 parameters and activations, fp32 grads and master weights, loss "
                      "scaling", action="store_true")
    loss_scale: float | None = flag("--loss-scale", None, "static loss scale (> 0; a power of 2 is exact); default "
                                    "with --fp16: dynamic scaling", type=float, check=POSITIVE)
    initial_loss_scale: float = flag("--initial-loss-scale", 2.0**32, _FP16 + "first dynamic loss scale (> 0)",
                                     check=POSITIVE)
    min_loss_scale: float = flag("--min-loss-scale", 1.0, _FP16 + "the dynamic scale never goes below this (> 0, "
                                 "<= --initial-loss-scale)", check=POSITIVE)
    loss_scale_window: int = flag("--loss-scale-window", 1000, _FP16 + "double the dynamic scale after this many "
                                  "steps without overflow (>= 1)", check=AT_LEAST_1)
    hysteresis: int = flag("--hysteresis", 2, _FP16 + "overflows tolerated before the dynamic scale is halved (>= 1)",
                           check=AT_LEAST_1)
    inject_overflow_at_iteration: int | None = flag(
        "--inject-overflow-at-iteration", None, "testing only: put an inf into one rank's gradients at iteration N "
        "(>= 1), as an fp16 overflow", type=int, metavar="N", check=AT_LEAST_1)
    params_dtype: str = derived("float32", "float32, bfloat16 (--bf16) or float16 (--fp16)")
    # Megatron-LM's precision-aware optimizer: where the optimizer's tensors are stored (their
    # bytes per parameter), never how it computes (fp32; optimizer/precision_adam.py)
    use_precision_aware_optimizer: bool = flag(
        "--use-precision-aware-optimizer", False, "store the master weights, the gradients the optimizer reads and "
        "Adam's moments in the dtypes of --main-params-dtype, --main-grads-dtype, --exp-avg-dtype and "
        "--exp-avg-sq-dtype; the update is computed in fp32", action="store_true")
    main_grads_dtype: str = flag("--main-grads-dtype", "fp32", "with --use-precision-aware-optimizer: dtype of the "
                                 "gradients the optimizer reads (bf16 needs --grad-reduce-in-bf16)",
                                 choices=["fp32", "bf16"])
    main_params_dtype: str = flag("--main-params-dtype", "fp32", "with --use-precision-aware-optimizer: dtype of the "
                                  "master weights of 16-bit parameters", choices=["fp32", "fp16"])
    exp_avg_dtype: str = flag("--exp-avg-dtype", "fp32", "with --use-precision-aware-optimizer: dtype of Adam's "
                              "first moment (Muon's momentum)", choices=["fp32", "fp16", "bf16", "fp8"])
    exp_avg_sq_dtype: str = flag("--exp-avg-sq-dtype", "fp32", "with --use-precision-aware-optimizer: dtype of "
                                 "Adam's second moment", choices=["fp32", "fp16", "bf16", "fp8"])
    # QK-clip (Kimi K2, arXiv 2507.20534, Sec. 2.1; Megatron-LM's megatron/core/optimizer/qk_clip.py):
    # after each step, the query and key projections of heads whose largest logit passed the threshold
    # are scaled back to it
    qk_clip: bool = flag("--qk-clip", False, "after each optimizer step, rescale the query and key projection rows "
                         "of every head (query group) whose largest pre-softmax attention logit in the step passed "
                         "--qk-clip-threshold, so that it would have been the threshold; logs the largest logit",
                         action="store_true")
    qk_clip_alpha: float = flag("--qk-clip-alpha", 0.5, "with --qk-clip: the query takes eta^alpha, the key "
                                "eta^(1-alpha) of the factor eta = threshold / max logit, in (0, 1)",
                                check=(lambda v: 0.0 < v < 1.0, "in (0, 1)"))
    qk_clip_threshold: float = flag("--qk-clip-threshold", 100.0, "with --qk-clip: the largest attention logit "
                                    "allowed (> 0)", check=POSITIVE)


__all__ = ["OptimizerConfig"]
