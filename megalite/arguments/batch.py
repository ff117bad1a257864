"""Training length, the global batch (constant, ramped up, stepped) and the learning-rate schedule,
as Megatron-LM's validate_args and num-microbatches calculator count them."""
from __future__ import annotations

from ..config.run import RunConfig
from .errors import fail, flag


def check_batch_schedule(c: RunConfig, dp_text: str) -> list[int]:
    """Fills the global batch, micro-batches and (sample-based) iterations; returns every global
    batch size the run takes."""
    from ..num_microbatches_calculator import NumMicroBatchesCalculator, parse_step_schedule
    t, dp = c.training, c.parallel.data_parallel_size
    if t.train_iters is None and t.train_samples is None:
        fail("--train-iters or --train-samples is required")
    if t.train_iters is not None and t.train_samples is not None:
        fail("--train-iters and --train-samples are mutually exclusive (iteration- or sample-based training)")
    sample_based = t.train_samples is not None
    mdp = t.micro_batch_size * dp
    schedule = None
    if t.step_batch_size_schedule is not None:
        if t.rampup_batch_size is not None:
            fail("--step-batch-size-schedule and --rampup-batch-size are mutually exclusive")
        if t.global_batch_size is not None:
            fail("--global-batch-size cannot be combined with --step-batch-size-schedule: the schedule's last "
                 "batch size is the global batch size (Megatron-LM refuses both as well)")
        try:
            schedule = parse_step_schedule(t.step_batch_size_schedule, c.model.seq_length)
        except ValueError as e:
            fail(f"--step-batch-size-schedule {t.step_batch_size_schedule!r}: {e}")
        t.global_batch_size = schedule[-1][1]
    elif t.global_batch_size is None:
        t.global_batch_size = mdp
    changing = "--rampup-batch-size" if t.rampup_batch_size else (
        "--step-batch-size-schedule" if schedule else None)
    if t.rampup_batch_size and not sample_based:
        # Megatron-LM's validate_args (while it had the ramp-up): 'expected no batch-size rampup for
        # iteration-based training'
        fail("--rampup-batch-size needs sample-based training: give --train-samples instead of --train-iters (and "
             "--lr-decay-samples / --lr-warmup-samples instead of the *-iters flags). Megatron-LM refuses "
             "it with --train-iters too: an iteration count does not say how many samples a changing batch "
             "trains on (a --step-batch-size-schedule may go with --train-iters)")
    # --step-batch-size-schedule with --train-iters (Megatron-LM today: update_train_iters keeps the
    # iteration count; each iteration's batch follows the samples consumed; the *-iters learning-rate
    # flags count iterations of the final global batch, check_lr_schedule)
    try:
        calc = NumMicroBatchesCalculator(t.global_batch_size, t.micro_batch_size, dp, t.rampup_batch_size, schedule)
    except ValueError as e:
        fail(f"--rampup-batch-size {' '.join(map(str, t.rampup_batch_size))}: {e}")
    # the batch sizes the run reaches: before --train-samples, or at the start of its last iteration
    sizes = calc.batch_sizes(t.train_samples if sample_based else calc.samples_after(t.train_iters - 1) + 1)
    for g in sizes:
        if g % mdp:
            what = f"--global-batch-size ({g})" if changing is None else f"global batch {g} of {changing}"
            fail(f"{what} is not divisible by --micro-batch-size ({t.micro_batch_size}) x {dp_text}")
    t.num_microbatches = t.global_batch_size // mdp
    eval_gbs = t.eval_global_batch_size or t.global_batch_size  # Megatron-LM's default
    if eval_gbs % mdp:
        fail(f"--eval-global-batch-size ({eval_gbs}) is not divisible by --micro-batch-size ({t.micro_batch_size}) "
             f"x {dp_text}")
    t.eval_num_microbatches = eval_gbs // mdp
    if sample_based:
        t.train_iters = calc.iterations_for(t.train_samples)
        if t.train_iters == 0:
            fail(f"--train-samples ({t.train_samples}) is less than the first global batch "
                 f"({calc.current_global_batch_size(0)})")
    return sizes


def check_lr_schedule(c: RunConfig) -> None:
    """The learning-rate schedule, in iterations (--train-iters) or samples (--train-samples), as
    Megatron-LM: the flags of the other kind are refused. Either way the schedule itself counts
    samples (OptimizerConfig.lr_*_samples): iterations are converted at the global batch size."""
    o, t = c.optimizer, c.training
    G = t.global_batch_size
    unit = "samples" if t.train_samples is not None else "iters"
    other = "iters" if unit == "samples" else "samples"
    for name in ("decay", "wsd_decay", "warmup"):
        dest = f"lr_{name}_{other}"
        if getattr(o, dest):  # None, or the warmup's default 0
            fail(f"{flag(dest)} belongs to {'iteration' if other == 'iters' else 'sample'}-based training; "
                 f"with {'--train-samples' if unit == 'samples' else '--train-iters'} give "
                 f"{flag(f'lr_{name}_{unit}')}")
    decay, warmup, wsd = (f"lr_decay_{unit}", f"lr_warmup_{unit}", f"lr_wsd_decay_{unit}")
    if getattr(o, decay) is None:
        setattr(o, decay, t.train_iters if unit == "iters" else t.train_samples)
    if o.lr_warmup_fraction is not None:
        if getattr(o, warmup):
            fail(f"--lr-warmup-fraction and {flag(warmup)} are mutually exclusive")
        setattr(o, warmup, int(o.lr_warmup_fraction * getattr(o, decay)))
    if getattr(o, warmup) > getattr(o, decay):
        fail(f"{flag(warmup)} ({getattr(o, warmup)}) exceeds {flag(decay)} ({getattr(o, decay)})")
    if o.lr_decay_style == "WSD":
        if getattr(o, wsd) is None:
            fail(f"--lr-decay-style WSD needs {flag(wsd)}")
        if getattr(o, wsd) > getattr(o, decay):
            fail(f"{flag(wsd)} ({getattr(o, wsd)}) exceeds {flag(decay)} ({getattr(o, decay)})")
    elif getattr(o, wsd) is not None:
        fail(f"{flag(wsd)} applies to --lr-decay-style WSD only")
    # the schedule in samples (exactly Megatron-LM's: a warmup fraction may end inside an iteration)
    scale = G if unit == "iters" else 1
    o.lr_decay_samples = getattr(o, decay) * scale
    o.lr_warmup_samples = (o.lr_warmup_fraction * o.lr_decay_samples if o.lr_warmup_fraction is not None
                           else getattr(o, warmup) * scale)
    o.lr_wsd_decay_samples = getattr(o, wsd) * scale if getattr(o, wsd) is not None else None
    if o.min_lr > o.lr:
        fail(f"--min-lr ({o.min_lr}) exceeds --lr ({o.lr})")
    if o.decoupled_min_lr is not None and o.decoupled_lr is None:
        fail("--decoupled-min-lr needs --decoupled-lr (Megatron-LM ignores it alone)")
    if o.decoupled_lr is not None:
        low = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        if low > o.decoupled_lr:
            which = "--decoupled-min-lr" if o.decoupled_min_lr is not None else "--min-lr"
            fail(f"the decoupled minimum learning rate ({which} {low}) exceeds --decoupled-lr ({o.decoupled_lr})")
