"""A resume's learning-rate schedule against its checkpoint's, as Megatron-LM's
OptimizerParamScheduler.load_state_dict: a schedule that differs is refused, naming every
difference with the checkpoint's value and this run's, unless

- `--override-opt_param-scheduler`: the command line's schedule, from the checkpoint's step on;
- `--use-checkpoint-opt_param-scheduler`: the checkpoint's schedule. Its values replace the
  command line's in the config, so the scheduler, the decoupled learning rate, the weight decay
  and the next checkpoint's record all follow it;

and both at once is refused (Megatron-LM asserts it). Without this, a resume with a longer
--train-iters (the decay length when no --lr-decay-iters is given) would stretch the schedule
under the step count it continues from, and the learning rate would jump.

A refusal names every difference in one message: the model's first (another --hidden-size,
--num-layers, --num-experts, ... that no schedule flag can fix, compared as the load will compare
them, checkpoint/native/state.py), then the schedule's with its two flags.

Settled by validation from the checkpoint's metadata.json (the validated config it records), so
every rank refuses alike before any process group exists. Only where the load restores the
schedule: not with --finetune or --no-load-optim (Megatron-LM loads the scheduler with the
optimizer), nor from a checkpoint without optimizer state, nor before the first checkpoint.

The fields: Megatron-LM's (peak and minimum learning rate, warmup and decay lengths, decay style;
its weight-decay schedule is megalite's constant --weight-decay) and what else megalite's
scheduler computes with (--lr-warmup-init, the WSD phase, --decoupled-lr / --decoupled-min-lr).
Lengths are compared in samples, as the scheduler counts them. A field the schedule's style does
not use is not compared (a constant schedule's decay length and minimum, a non-WSD schedule's WSD
phase, the warmup's start without warmup), so a constant-rate run may go on for longer."""
from __future__ import annotations

import dataclasses
import os

from ..config.run import RunConfig, from_saved
from ..errors import CheckpointError
from .errors import fail, flag

OVERRIDE, USE_CHECKPOINT = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"
# OptimizerConfig fields the learning-rate schedule is made of (validation has filled the samples)
SCHEDULE = ("lr", "min_lr", "lr_decay_style", "lr_warmup_samples", "lr_warmup_init", "lr_decay_samples",
            "lr_wsd_decay_samples", "lr_wsd_decay_style", "decoupled_lr", "decoupled_min_lr", "weight_decay")
# the lengths, counted in samples: field -> (its flag's stem, the words for it)
LENGTHS = {"lr_warmup_samples": ("warmup", "the warmup"), "lr_decay_samples": ("decay", "the decay length"),
           "lr_wsd_decay_samples": ("wsd_decay", "the WSD decay phase")}


def check_schedule_flags(c: RunConfig) -> None:
    ck = c.checkpoint
    if ck.override_opt_param_scheduler and ck.use_checkpoint_opt_param_scheduler:
        fail(f"{OVERRIDE} and {USE_CHECKPOINT} are mutually exclusive: the command line's learning-rate schedule "
             "or the checkpoint's (Megatron-LM refuses both too)")
    for name, on in ((OVERRIDE, ck.override_opt_param_scheduler), (USE_CHECKPOINT, ck.use_checkpoint_opt_param_scheduler)):
        if on and not ck.load:
            fail(f"{name} needs --load (it chooses between the checkpoint's learning-rate schedule and the "
                 "command line's)")


def used_fields(o: dict) -> set[str]:
    """The SCHEDULE fields a schedule (OptimizerConfig as a dict) computes with."""
    keys = {"lr", "lr_decay_style", "lr_warmup_samples", "decoupled_lr", "decoupled_min_lr", "weight_decay"}
    if o.get("lr_warmup_samples"):
        keys.add("lr_warmup_init")
    if o.get("lr_decay_style") != "constant":
        keys |= {"min_lr", "lr_decay_samples"}
    if o.get("lr_decay_style") == "WSD":
        keys |= {"lr_wsd_decay_samples", "lr_wsd_decay_style"}
    return keys


def schedule_differences(saved: dict, run: dict) -> list[str]:
    """The SCHEDULE fields where the checkpoint's optimizer section `saved` and this run's `run`
    differ, among those either schedule uses; a field the checkpoint does not record (an older
    megalite) is skipped, as Megatron-LM skips a value its checkpoint lacks."""
    keys = used_fields(saved) | used_fields(run)
    return [k for k in SCHEDULE if k in keys and k in saved and saved[k] != run.get(k)]


def settle_schedule(c: RunConfig) -> None:
    """Refuse, override or take the checkpoint's schedule (see the module docstring), in place."""
    ck = c.checkpoint
    chosen = OVERRIDE if ck.override_opt_param_scheduler else USE_CHECKPOINT if ck.use_checkpoint_opt_param_scheduler \
        else None
    why_not = _not_restored(c)
    if why_not is not None:
        if chosen:
            c.notices.append(f"{chosen} has no effect: {why_not}")
        return
    saved = _saved(ck.load)
    if saved is None or not saved[2]:
        if chosen:
            c.notices.append(f"{chosen} has no effect: " + ("no checkpoint under --load yet" if saved is None else
                                                            "the checkpoint holds no optimizer state"))
        return
    where, sections, _, saved_model, foreign = saved
    old = sections.get("optimizer", {})
    differences = schedule_differences(old, dataclasses.asdict(c.optimizer))
    if not differences:
        return
    sides = ((old, sections.get("training", {})), (dataclasses.asdict(c.optimizer), dataclasses.asdict(c.training)))
    batches = {t.get("global_batch_size") for _, t in sides}
    text = "; ".join(f"{_label(c, k)} is {_value(k, *sides[0], len(batches) > 1)} in the checkpoint and "
                     f"{_value(k, *sides[1], len(batches) > 1)} in this run" for k in differences)
    if chosen == OVERRIDE:
        c.notices.append(f"{OVERRIDE}: this run's learning-rate schedule replaces that of {where} from its step on "
                         f"({text})")
    elif chosen == USE_CHECKPOINT:
        for k in SCHEDULE:
            if k in old:
                setattr(c.optimizer, k, old[k])
        c.notices.append(f"{USE_CHECKPOINT}: the learning-rate schedule of {where} continues, over the command "
                         f"line's ({text})")
    else:
        model = _model_mismatch(c, saved_model, foreign, where)
        schedule = (f"the learning-rate schedule differs from the checkpoint's ({where}): {text}" if model is None
                    else f"{model}. The learning-rate schedule differs too: {text}")
        fail(f"--load {ck.load}: {schedule}. Give {USE_CHECKPOINT} to continue the checkpoint's schedule, or "
             f"{OVERRIDE} to run this command line's from the checkpoint's step on")


def _model_mismatch(c: RunConfig, saved: dict, foreign: bool, where: str) -> str | None:
    """What the load will say of the checkpoint's model against this run's (checkpoint/native/state.py
    check_model_config; a Megatron-LM checkpoint's args name some settings only, as there), or
    None where they agree. The vocabulary is compared where validation knows it (--vocab-size); a
    tokenizer file's is left to the load."""
    from ..checkpoint.native.state import check_model_config
    current = c.model.to_dict()
    current["vocab_size"] = c.tokenizer.vocab_size or saved.get("vocab_size")
    try:
        check_model_config({**current, **saved} if foreign else saved, current, where)
    except CheckpointError as e:
        return str(e)
    return None


def _not_restored(c: RunConfig) -> str | None:
    """Why the load will not restore the schedule, if it will not."""
    ck = c.checkpoint
    if not ck.load:
        return "there is no --load"
    if ck.finetune:
        return "--finetune starts a fresh schedule"
    if ck.moe_use_upcycling:
        return "--moe-use-upcycling starts a fresh schedule (Megatron-LM loads no optimizer or scheduler then)"
    if ck.no_load_optim:
        return "--no-load-optim starts a fresh schedule (Megatron-LM loads the scheduler with the optimizer)"
    if c.training.dry_run:
        return "--dry-run loads no checkpoint"
    return None


def _saved(load: str):
    """(directory, config sections, whether it holds optimizer state, its model as the load
    compares it, whether it is Megatron-LM's) of the latest checkpoint under `load`; None when
    there is none yet."""
    from ..checkpoint.files import checked_metadata
    from ..checkpoint.paths import TRACKER
    if not os.path.isfile(os.path.join(load, TRACKER)):
        return None
    try:
        meta = checked_metadata(load, "--load")
    except CheckpointError as e:
        fail(str(e))
    model = {k: v for k, v in meta.get("model_config", {}).items() if k not in meta.get("derived", ())}
    return meta["dir"], from_saved(meta), bool(meta.get("has_optimizer_state", True)), model, "derived" in meta


def _label(c: RunConfig, key: str) -> str:
    """How the message names a field: the flag of this run's command line that sets it."""
    if key not in LENGTHS:
        return flag(key)
    stem, words = LENGTHS[key]
    unit = "samples" if c.training.train_samples is not None else "iters"
    own = f"lr_{stem}_{unit}"
    if key == "lr_warmup_samples" and c.optimizer.lr_warmup_fraction is not None:
        return f"{words} (--lr-warmup-fraction {c.optimizer.lr_warmup_fraction} of the decay)"
    if key == "lr_decay_samples" and f"optimizer.{own}" not in c.explicit:
        return f"{words} ({'--train-iters' if unit == 'iters' else '--train-samples'}, with no {flag(own)})"
    return f"{words} ({flag(own)})"


def _value(key: str, o: dict, t: dict, batches_differ: bool) -> str:
    """A field's value on one side: a length in that side's iterations where it trained by
    iterations (and the length is a whole number of its global batches), else in samples."""
    value = o.get(key)
    if key not in LENGTHS or value is None:
        return "none" if value is None else str(value)
    batch = t.get("global_batch_size")
    if t.get("train_samples") is None and batch and value % batch == 0:
        return f"{int(value // batch)} iterations" + (f" of {batch} samples" if batches_differ else "")
    return f"{value:g} samples" if isinstance(value, float) else f"{value} samples"
