"""The global batch size as a function of the samples consumed so far, and from it the number of
micro-batches per iteration (Megatron-LM's megatron/core/num_microbatches_calculator.py).

Three schedules, all functions of `consumed_samples` only, so a resumed run (which restores
consumed_samples from its checkpoint) picks up the batch size an uninterrupted run would use:

- constant: `--global-batch-size`;
- ramp-up, `--rampup-batch-size START INCREMENT SAMPLES` (GPT-3, Brown et al. 2020, Sec. 2.3):
  (G - START) / INCREMENT increments spread evenly over SAMPLES samples; after that G;
- steps, `--step-batch-size-schedule "T0:B0 T1:B1 ..."`: batch B_i from T_i tokens on (T0 = 0;
  thresholds take K/M/B/T suffixes and are converted to samples by // --seq-length, as Megatron-LM
  does); the last B is the final global batch.

Every batch size is a multiple of micro-batch x DP, so an iteration is always whole micro-batches
on every DP rank. Nothing here imports torch: `validate_args` checks schedules with it.
"""
from __future__ import annotations

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _parse_number(text: str, what: str) -> int:
    t = text.strip().upper()
    mult = _SUFFIXES.get(t[-1:], 1)
    if mult > 1:
        t = t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number (suffixes K, M, B, T allowed)") from None
    if value != value or value < 0 or value != int(value):
        raise ValueError(f"{what} {text!r} must be a non-negative integer")
    return int(value)


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """'0:768 250B:1536' -> [(0, 768), (250e9 // seq_length, 1536)]: (first sample, global batch),
    sorted. Raises ValueError naming the bad entry."""
    entries = text.replace(",", " ").split()
    if not entries:
        raise ValueError("is empty; give 'TOKENS:BATCH ...' pairs, the first at 0 tokens")
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f"entry {entry!r} is not TOKENS:BATCH")
        tokens, batch = entry.split(":", 1)
        threshold = _parse_number(tokens, "threshold") // seq_length
        size = _parse_number(batch, "batch size")
        if size < 1:
            raise ValueError(f"entry {entry!r}: the batch size must be >= 1")
        schedule.append((threshold, size))
    schedule.sort()
    if schedule[0][0] != 0:
        raise ValueError(f"the first threshold must be 0 tokens, got {schedule[0][0] * seq_length}")
    for (a, _), (b, _) in zip(schedule, schedule[1:]):
        if a == b:
            raise ValueError(f"two entries start at the same sample {a} (thresholds are tokens // --seq-length "
                             f"{seq_length}); thresholds must increase")
    return schedule


class NumMicroBatchesCalculator:
    """global_batch_size(consumed) and num_microbatches(consumed) for one schedule."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: list[int] | None = None, step_schedule: list[tuple[int, int]] | None = None):
        self.micro_batch_size, self.data_parallel_size = micro_batch_size, data_parallel_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.rampup, self.steps = None, None
        if rampup_batch_size is not None and step_schedule is not None:
            raise ValueError("a ramp-up and a step schedule are mutually exclusive")
        if step_schedule is not None:
            self.steps = list(step_schedule)
            global_batch_size = self.steps[-1][1]
        elif rampup_batch_size is not None:
            start, increment, samples = (int(v) for v in rampup_batch_size)
            if start < 1 or increment < 1 or samples < 1:
                raise ValueError(f"START, INCREMENT and SAMPLES must be >= 1, got {start} {increment} {samples}")
            diff = global_batch_size - start
            if diff <= 0:
                raise ValueError(f"START ({start}) must be below the global batch size ({global_batch_size}) "
                                 f"it ramps up to")
            if diff % increment:
                raise ValueError(f"the global batch size ({global_batch_size}) minus START ({start}) = {diff} is "
                                 f"not a multiple of INCREMENT ({increment})")
            # Megatron-LM: each of the diff/increment increments lasts SAMPLES / increments samples
            self.rampup = (start, increment, samples, samples / (diff // increment))
        self.global_batch_size = global_batch_size  # the final one

    def current_global_batch_size(self, consumed_samples: int) -> int:
        if self.steps is not None:
            size = self.steps[0][1]
            for threshold, batch in self.steps:
                if consumed_samples < threshold:
                    break
                size = batch
            return size
        if self.rampup is not None:
            start, increment, samples, per_increment = self.rampup
            if consumed_samples > samples:
                return self.global_batch_size
            return start + int(consumed_samples / per_increment) * increment
        return self.global_batch_size

    def num_microbatches(self, consumed_samples: int) -> int:
        """Micro-batches per DP rank for the iteration that starts at `consumed_samples`."""
        return self.current_global_batch_size(consumed_samples) // self.micro_times_dp

    def batch_sizes(self, up_to_samples: int | None = None) -> list[int]:
        """Every global batch size the schedule takes (before `up_to_samples`), in order."""
        if self.steps is not None:
            return [b for t, b in self.steps if up_to_samples is None or t < up_to_samples]
        if self.rampup is not None:
            start, increment = self.rampup[:2]
            return list(range(start, self.global_batch_size + 1, increment))
        return [self.global_batch_size]

    def iterations_for(self, train_samples: int) -> int:
        """Whole global batches that fit in `train_samples` (a partial last batch is dropped, as in
        Megatron-LM). Exact for every schedule; Megatron-LM's update_train_iters counts the
        ramp-up phase whole even when --train-samples ends inside it."""
        if self.steps is None and self.rampup is None:
            return train_samples // self.global_batch_size
        iterations, consumed = 0, 0
        while True:
            g = self.current_global_batch_size(consumed)
            if consumed + g > train_samples:
                return iterations
            if g == self.global_batch_size and (self.steps is None or consumed >= self.steps[-1][0]):
                # the schedule is flat from here: count the rest at once
                return iterations + (train_samples - consumed) // g
            consumed += g
            iterations += 1

    def samples_after(self, iterations: int) -> int:
        """consumed_samples after `iterations` iterations from 0."""
        consumed = 0
        for _ in range(iterations):
            consumed += self.current_global_batch_size(consumed)
        return consumed

    def describe(self) -> str:
        if self.steps is not None:
            return "global batch by samples consumed: " + ", ".join(f"{b} from {t}" for t, b in self.steps)
        if self.rampup is not None:
            start, increment, samples, _ = self.rampup
            return (f"global batch ramps from {start} by {increment} to {self.global_batch_size} "
                    f"over {samples} samples")
        return f"global batch {self.global_batch_size}"


def build_num_microbatches_calculator(t, data_parallel_size: int) -> NumMicroBatchesCalculator:
    """From a TrainingConfig (flags already validated)."""
    steps = parse_step_schedule(t.step_batch_size_schedule, t.seq_length) if t.step_batch_size_schedule else None
    return NumMicroBatchesCalculator(t.global_batch_size, t.micro_batch_size, data_parallel_size,
                                     t.rampup_batch_size, steps)
