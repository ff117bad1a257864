#!/usr/bin/env python3
"""Train a sample of Megatron-LM's own test configurations (tools/megatron_configs.py reads them) on
this CPU, shrunk, and write which ran:

    python tools/megatron_sample.py [--out DIR] [--results FILE] [--only NAME ...] [--list]

The sample: a greedy cover of every flag of the accepted configurations, with every TEST_TYPE, then
more configurations up to --count (30). Each is shrunk (`shrink`): widths (hidden 128, 8 heads,
the FFN, expert, MLA and vocabulary sizes), sequence 64, micro-batch 1 and the fewest micro-batches
its layout accepts, and iteration counts (--train-iters 16; the other iteration and sample counts
scaled alike, the learning-rate schedule's lengths at most the run's: decay over the 16 iterations,
warmup over at most 4); every other flag and value is as written, the parallel layout and world size
(8 ranks, 4 for a _1node file) included, on gloo. The CI's paths are local: a byte-level BPE of
512 tokens trained on the bundled corpus (GPT-2's vocab.json / merges.txt; a SentencePiece model
for the release files) and the corpus tokenized with it.

How a TEST_TYPE runs (Megatron-LM's tests/functional_tests/shell_test_utils/run_ci_test.sh):
regular and release train once; ckpt-resume trains, saves half-way, and a second run resumes from
the half-way checkpoint: its losses must equal the first run's, exactly; frozen-start and
frozen-resume load a "frozen" checkpoint (made here by a run of the same configuration) and train
on; checkpoint-consistency runs each MODEL_ARGS_N from the frozen checkpoint for one iteration at
its own world size. Every run's losses must be finite and, over a run of 16 iterations, fall.

The results file (default benchmarks/RESULTS_megatron_sample.md) records the hardware, commit,
command and, per configuration, its type, world size, shrunk flags and losses, and the resume check.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import megatron_configs as mc  # noqa: E402
from megalite.rendezvous import free_port  # noqa: E402

ITERS = 16
SEQ = 64
# flags a configuration runs with changed, by name, said in the results (none now: the re-run state
# machine the checkpoint-consistency and frozen-start files ask for has landed)
SWAPS: dict[str, dict] = {}


# -- the data ------------------------------------------------------------------------------------
def prepare_data(base: str) -> dict[str, str]:
    """The CI's ${VAR} paths under `base`, with the files the configurations name made small."""
    paths = mc.stand_in_paths(base)
    data = paths["DATA_PATH"]
    work = os.path.join(base, "tokenizer")
    done = os.path.join(base, ".prepared")
    if os.path.exists(done):
        return paths
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")

    def tool(*argv):
        subprocess.run([sys.executable, *map(str, argv)], env=env, check=True, capture_output=True, text=True)

    tool(os.path.join(ROOT, "examples", "megatron", "make_tiny_data.py"), work, "--documents", "3000")
    for sub in ("text/common_pile/v01_filtered_data", "text/the_pile/shard00"):
        d = os.path.join(data, sub)
        os.makedirs(os.path.join(d, "bpe"), exist_ok=True)
        for f in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(work, f), os.path.join(d, "bpe", f))
        tool(os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", os.path.join(work, "corpus.jsonl"),
             "--output-prefix", os.path.join(d, "my-gpt3_00"), "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", os.path.join(d, "bpe", "vocab.json"), "--merge-file", os.path.join(d, "bpe", "merges.txt"),
             "--append-eod")
    os.makedirs(os.path.join(data, "utils"), exist_ok=True)
    tool(os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", os.path.join(work, "corpus.jsonl"),
         "--model-prefix", os.path.join(data, "utils", "nemotron_2_256k"), "--vocab-size", "512",
         "--model-type", "bpe", "--num-threads", "1")
    open(done, "w").close()
    return paths


# -- which configurations ------------------------------------------------------------------------
def accepted_cases(paths: dict) -> list:
    """The configurations pretrain_gpt.py accepts as written (SWAPS applied)."""
    out = []
    for case in mc.load_cases():
        for run in case.runs:
            run.argv = swap(run.argv, SWAPS.get(case.name, {}))
        _, refusal = mc.validate_case(case, paths)
        if refusal is None:
            out.append(case)
    return out


def swap(argv: list[str], values: dict) -> list[str]:
    """argv with the values of some flags replaced."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a in values:
            out[i + 1] = values[a]
    return out


def flags_of(case) -> set[str]:
    return {a for run in case.runs for a in run.argv if a.startswith("--")}


def choose(cases: list, count: int) -> list:
    """Every flag and every TEST_TYPE of `cases` covered (greedy, fewest ranks first on ties), then
    more configurations of the most flags up to `count`."""
    left = set().union(*(flags_of(c) for c in cases))
    types = {c.test_type for c in cases}
    chosen = []
    while left or types - {c.test_type for c in chosen}:
        missing = types - {c.test_type for c in chosen}
        pool = [c for c in cases if c not in chosen and (not missing or c.test_type in missing or left)]
        best = max(pool, key=lambda c: (c.test_type in missing, len(flags_of(c) & left),
                                       -max(r.world_size for r in c.runs)))
        chosen.append(best)
        left -= flags_of(best)
    rest = sorted((c for c in cases if c not in chosen), key=lambda c: (-len(flags_of(c)), c.name))
    return chosen + rest[:max(0, count - len(chosen))]


# -- shrinking -----------------------------------------------------------------------------------
WIDTHS = {"--hidden-size": "128", "--ffn-hidden-size": "256", "--num-attention-heads": "8", "--kv-channels": "16",
          "--moe-ffn-hidden-size": "64", "--moe-shared-expert-intermediate-size": "64", "--q-lora-rank": "32",
          "--kv-lora-rank": "32", "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16",
          "--vocab-size": "511", "--seq-length": str(SEQ), "--max-position-embeddings": str(SEQ),
          "--micro-batch-size": "1", "--log-interval": "1"}
# iteration counts, scaled with --train-iters (at least 1)
ITERATION_FLAGS = ("--save-interval", "--eval-interval", "--exit-interval", "--manual-gc-interval", "--lr-decay-iters",
                   "--lr-warmup-iters", "--lr-wsd-decay-iters", "--save-retain-interval")
# the learning-rate schedule's lengths at most the run's (a decay over 320000 iterations, warmed up over
# 1% of them, would keep a 16-iteration run at a learning rate near 0): flag -> its cap
SCHEDULE_FLAGS = {"--lr-decay-iters": lambda n: n, "--lr-wsd-decay-iters": lambda n: n // 2,
                  "--lr-warmup-iters": lambda n: max(1, n // 4)}
SAMPLE_FLAGS = ("--train-samples", "--lr-decay-samples", "--lr-warmup-samples", "--lr-wsd-decay-samples")


def _pairs(argv: list[str]) -> list[list[str]]:
    out = []
    for a in argv:
        if a.startswith("--") or not out:
            out.append([a])
        else:
            out[-1].append(a)
    return out


def _value(argv, flag, default=None):
    for p in _pairs(argv):
        if p[0] == flag and len(p) > 1:
            return p[1]
    return default


def shrink(argv: list[str], world: int, paths: dict, iters: int = ITERS) -> list[str]:
    """A run's arguments shrunk (module docstring): widths, sequence, batch and iteration counts;
    the number of micro-batches the smallest its layout validates."""
    pairs = _pairs(argv)
    heads = int(_value(argv, "--num-attention-heads", "8"))
    groups = int(_value(argv, "--num-query-groups", heads))
    tp = int(_value(argv, "--tensor-model-parallel-size", "1"))
    ratio = max(1, heads // max(groups, 1))
    new_groups = next(g for g in (8 // ratio, 4, 2, 1, 8) if g >= 1 and 8 % g == 0 and g % tp == 0 or g == 8)
    iters_written = int(_value(argv, "--train-iters", "0") or 0)
    scale = iters / iters_written if iters_written else None
    out = []
    for p in pairs:
        flag = p[0]
        if flag in WIDTHS and len(p) > 1:
            p = [flag, WIDTHS[flag]]
        elif flag == "--num-query-groups":
            p = [flag, str(new_groups)]
        elif flag == "--train-iters":
            p = [flag, str(iters)]
        elif flag == "--eval-iters" and int(p[1]) > 0:
            p = [flag, "1"]
        elif flag in ITERATION_FLAGS and len(p) > 1:
            v = int(p[1])
            v = max(1, round(v * scale)) if scale and v > iters else min(v, iters)
            if flag in SCHEDULE_FLAGS:  # the learning-rate schedule within the run, so that it trains
                v = min(v, SCHEDULE_FLAGS[flag](iters))
            p = [flag, str(v)]
        elif flag in ("--global-batch-size", "--eval-global-batch-size", "--step-batch-size-schedule") + SAMPLE_FLAGS:
            continue  # set below, from the micro-batches that validate
        out.append(p)
    flat = [x for p in out for x in p]
    return _with_batches(flat, argv, world, paths, iters)


def _with_batches(flat: list[str], written: list[str], world: int, paths: dict, iters: int) -> list[str]:
    """The fewest micro-batches (global batch = that x DP x micro) the run's layout validates, and
    the sample-based and step-schedule flags scaled to it."""
    from megalite.arguments import parse_args, validate_args
    from megalite.errors import UserError
    schedule = _value(written, "--step-batch-size-schedule")
    samples = {f: _value(written, f) for f in SAMPLE_FLAGS if _value(written, f) is not None}
    last = None
    for m in range(1, 65):
        trial = list(flat)
        probe = validate_probe(trial, world, paths)
        dp = probe if probe else 1
        gbs = m * dp
        if schedule:
            trial += ["--step-batch-size-schedule", f"0:{gbs} {2 * gbs * SEQ}:{2 * gbs} {6 * gbs * SEQ}:{3 * gbs}"]
            final = 3 * gbs
        else:
            trial += ["--global-batch-size", str(gbs)]
            final = gbs
            if _value(written, "--eval-global-batch-size"):
                trial += ["--eval-global-batch-size", str(gbs)]
        for f, v in samples.items():
            trial += [f, str(iters * final if f in ("--train-samples", "--lr-decay-samples") else
                             (final if int(float(v)) > 0 else 0) if f == "--lr-warmup-samples" else iters * final // 2)]
        if "--train-samples" in samples:
            trial = [x for x in _drop(trial, "--train-iters")]
        try:
            validate_args(parse_args(mc.substitute(trial, paths)), world, check_files=False)
            return trial
        except (UserError, SystemExit) as e:
            last = e
    raise RuntimeError(f"no batch size validates: {last}")


def _drop(argv: list[str], flag: str) -> list[str]:
    return [x for p in _pairs(argv) if p[0] != flag for x in p]


def validate_probe(argv: list[str], world: int, paths: dict) -> int | None:
    """The data-parallel size of the run's grid (TP x PP x CP of the flags)."""
    tp = int(_value(argv, "--tensor-model-parallel-size", "1"))
    pp = int(_value(argv, "--pipeline-model-parallel-size", "1"))
    cp = int(_value(argv, "--context-parallel-size", "1"))
    return world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else None


# -- running -------------------------------------------------------------------------------------
def launch(argv: list[str], world: int, env: dict, log: str, timeout: float) -> list[dict]:
    """pretrain_gpt.py on `world` gloo ranks (torchrun); the JSONL records it wrote."""
    jsonl = log + ".jsonl"
    if os.path.exists(jsonl):
        os.remove(jsonl)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(free_port()),
           os.path.join(ROOT, "pretrain_gpt.py"), *argv, "--log-jsonl", jsonl]
    full = dict(os.environ, **env, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, env=full, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=os.path.dirname(log))
    if proc.returncode != 0:
        raise RuntimeError(f"exit status {proc.returncode} ({os.path.basename(log)}): {_last_error(log)}")
    with open(jsonl) as f:
        return [json.loads(line) for line in f]


def _last_error(log: str) -> str:
    lines = [l.strip() for l in open(log, errors="replace") if "error" in l.lower()]
    return lines[-1][:300] if lines else "see the log"


def losses(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in records if "consumed_samples" in r}


def _set_latest(root: str, iteration: int, drop_after: bool = True) -> None:
    """As the CI after a ckpt-resume's first run: the later checkpoints removed, the latest
    pointer at `iteration`."""
    for name in os.listdir(root):
        m = re.fullmatch(r"iter_(\d+)", name)
        if m and int(m.group(1)) > iteration and drop_after:
            shutil.rmtree(os.path.join(root, name))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{iteration}\n")


def run_case(case, paths: dict, work: str, timeout: float, iters: int = ITERS) -> dict:
    """Train one configuration as its TEST_TYPE says (`iters` iterations); returns its record."""
    base = os.path.join(work, case.name.replace("/", "__"))
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    half = iters // 2

    def run_paths(save: str, load: str) -> dict:
        return dict(paths, CHECKPOINT_SAVE_PATH=os.path.join(base, save), CHECKPOINT_LOAD_PATH=os.path.join(base, load),
                    TENSORBOARD_PATH=os.path.join(base, "tb"), DATA_CACHE_PATH=os.path.join(base, "cache"))

    def go(run, p: dict, name: str, extra: list[str] = ()) -> tuple[list[str], dict[int, float]]:
        os.makedirs(p["CHECKPOINT_LOAD_PATH"], exist_ok=True)
        argv = shrink(run.argv, run.world_size, p, iters)
        argv = mc.substitute(_drop_all(argv, [e for e in extra if e.startswith("--")]) + list(extra), p)
        return argv, losses(launch(argv, run.world_size, run.env, os.path.join(base, name + ".log"), timeout))

    record = {"name": case.name, "test_type": case.test_type, "world_size": [r.world_size for r in case.runs]}
    first = case.runs[0]
    t0 = time.time()
    if case.test_type in ("regular", "release"):
        argv, got = go(first, run_paths("save", "empty"), "run")
        record.update(argv=argv, losses=got)
    elif case.test_type in ("ckpt-resume", "frozen-resume"):
        save = ["--save-interval", str(half)]
        argv, straight = go(first, run_paths("save", "empty"), "run1", save)
        _set_latest(os.path.join(base, "save"), half)
        # ckpt-resume: the same paths, the load reading the save (the CI's); frozen-resume: the
        # frozen checkpoint read, a fresh save directory
        p2 = run_paths("save", "save") if case.test_type == "ckpt-resume" else run_paths("save2", "save")
        _, resumed = go(first, p2, "run2", save)
        record.update(argv=argv, losses=straight, resumed=resumed,
                      resume_exact=all(resumed.get(i) == straight.get(i) for i in range(half + 1, iters + 1))
                      and sorted(resumed) == list(range(half + 1, iters + 1)))
    elif case.test_type == "frozen-start":
        frozen = mc.substitute([_value(first.argv, "--load")], run_paths("save", "frozen"))[0]
        # the frozen checkpoint: the same run stopped half-way (its schedule the same)
        go(first, run_paths("frozen", "empty"), "frozen", ["--exit-interval", str(half), "--save", frozen])
        argv, got = go(first, run_paths("save", "frozen"), "run")
        record.update(argv=argv, losses=got)
    elif case.test_type == "checkpoint-consistency":
        frozen = mc.substitute([_value(first.argv, "--load")], run_paths("save", "frozen"))[0]
        go(first, run_paths("frozen", "empty"), "frozen", ["--save", frozen])
        firsts = {}
        for run in case.runs:
            argv, got = go(run, run_paths("save_" + run.key, "frozen"), run.key)
            firsts[run.key] = got.get(1) if got else None
        record.update(argv=argv, losses=firsts, consistent=_close(list(firsts.values()), 2e-2))
    record["seconds"] = round(time.time() - t0, 1)
    values = list(record["losses"].values())
    record["finite"] = all(v is not None and math.isfinite(v) for v in values)
    record["falls"] = case.test_type == "checkpoint-consistency" or (len(values) > 2 and
                                                                       sum(values[-3:]) < sum(values[:3]))
    return record


def _drop_all(argv: list[str], flags: list[str]) -> list[str]:
    for f in flags:
        argv = _drop(argv, f)
    return argv


def _close(values: list, rtol: float) -> bool:
    return all(v is not None for v in values) and max(values) - min(values) <= rtol * abs(values[0])


def ok(record: dict) -> bool:
    return record.get("error") is None and record["finite"] and record["falls"] and \
        record.get("resume_exact", True) and record.get("consistent", True)


# -- the results ---------------------------------------------------------------------------------
def write_results(path: str, records: list[dict], command: str, chosen: list, accepted: int) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    passed = sum(ok(r) for r in records)
    types = sorted({r["test_type"] for r in records})
    lines = [
        "# Megatron-LM's test configurations trained shrunk on the CPU",
        "",
        f"`{command}` at commit {commit} on {platform.machine()} ({os.cpu_count()} cores), "
        f"{time.strftime('%Y-%m-%d')}: {len(records)} of the {accepted} accepted configurations (tools/megatron_sample.py: "
        f"every flag of the accepted ones and every TEST_TYPE, {', '.join(types)}), shrunk to hidden 128, 8 heads, "
        f"sequence {SEQ}, micro-batch 1, {ITERS} iterations, on gloo at each file's world size. "
        f"**{passed} of {len(records)} passed**: losses finite and falling (mean of the last 3 below the first 3), "
        "resumes equal to the uninterrupted run's losses exactly, checkpoint-consistency's layouts within 2%.",
        "",
        "| configuration | type | world | first -> last loss | resume | s | result |",
        "|---|---|---|---|---|---|---|"]
    for r in records:
        values = list(r.get("losses", {}).values())
        span = f"{values[0]:.3f} -> {values[-1]:.3f}" if values and None not in values else "-"
        resume = ("exact" if r.get("resume_exact") else "DIFFERS") if "resume_exact" in r else \
            ("consistent" if r.get("consistent") else "DIFFERS") if "consistent" in r else ""
        result = "ok" if ok(r) else f"FAILED {r.get('error') or ''}"
        lines.append(f"| {r['name']}{' (swapped: ' + json.dumps(SWAPS[r['name']]) + ')' if r['name'] in SWAPS else ''} "
                     f"| {r['test_type']} | {'/'.join(map(str, r['world_size']))} | {span} | {resume} | "
                     f"{r.get('seconds', '')} | {result} |")
    lines += ["", "Each run's shrunk command line is in the JSON beside this file."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(records, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS_megatron_sample.md"))
    p.add_argument("--count", type=int, default=30, help="configurations at least (30)")
    p.add_argument("--only", nargs="+", default=None, help="these configurations (gpt/NAME) instead of the sample")
    p.add_argument("--list", action="store_true", help="print the sample and stop")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--keep-passed", action="store_true", help="configurations the results JSON already records as "
                   "passed are not run again (their records kept)")
    a = p.parse_args(argv)
    if not os.path.isdir(mc.FOLDER):
        print(f"error: {mc.FOLDER} is absent: Megatron-LM's configurations are not here")
        return 2
    work = a.out or tempfile.mkdtemp(prefix="megatron-sample-")
    paths = prepare_data(work)
    cases = accepted_cases(paths)
    chosen = [c for c in cases if c.name in a.only] if a.only else choose(cases, a.count)
    if a.list:
        for c in chosen:
            print(f"{c.test_type:22s} {'/'.join(str(r.world_size) for r in c.runs):5s} {c.name}")
        print(f"{len(chosen)} configurations, {len(set().union(*(flags_of(c) for c in chosen)))} distinct flags")
        return 0
    records, kept = [], {}
    previous = os.path.splitext(a.results)[0] + ".json"
    if a.keep_passed and os.path.exists(previous):
        kept = {r["name"]: r for r in json.load(open(previous)) if ok(r)}
    for c in chosen:
        if c.name in kept:
            records.append(kept[c.name])
            continue
        try:
            record = run_case(c, paths, work, a.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # recorded; the others still run
            record = {"name": c.name, "test_type": c.test_type, "world_size": [r.world_size for r in c.runs],
                      "error": str(e)[:300], "finite": False, "falls": False}
        records.append(record)
        print(f"{'ok    ' if ok(record) else 'FAILED'} {c.name} {record.get('seconds', '')} s {record.get('error', '')}",
              flush=True)
        write_results(a.results, records, "python tools/megatron_sample.py" + (" --only ..." if a.only else ""),
                      chosen, len(cases))
    return 0 if all(ok(r) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
