#!/usr/bin/env python3
"""Plot the JSONL logs of one or more runs (pretrain_gpt.py --log-jsonl) side by side.

    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --output compare.png

Three panels against iterations: training loss, validation loss, throughput (tokens/s); one
line per run, labelled by its file name (by as much of its path as tells the runs apart).

    python tools/plot_metrics.py run.jsonl --timeline --output timeline.png   [--iteration N]

draws instead a run's pipeline timeline (--log-pipeline-timeline: its last `pipeline_timeline`
record, or iteration N's): one row per rank, a bar per pass (F forward, B input gradient,
W weight gradient, BW a whole backward) labelled with its micro-batch, idle time left blank,
each rank's idle fraction beside its row.
Needs matplotlib (pip install matplotlib); draws off-screen (Agg), no display needed. An
--output that exists is refused (nothing is overwritten).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.errors import ArgumentParser, InputError, MissingPackage, cli  # noqa: E402

PROG = "tools/plot_metrics.py"


def load_run(path: str) -> dict[str, list[tuple[int, float]]]:
    """{'train_loss', 'valid_loss', 'tokens_per_sec'} -> [(iteration, value), ...] from a JSONL
    log. A run resumed into the same file appends: a later record for an iteration replaces an
    earlier one."""
    series: dict[str, dict[int, float]] = {"train_loss": {}, "valid_loss": {}, "tokens_per_sec": {}}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(r, dict) or "iteration" not in r or "lm_loss" not in r:
                continue  # memory footprint and other events
            it = int(r["iteration"])
            if r.get("split") == "valid":
                series["valid_loss"][it] = float(r["lm_loss"])
            elif "split" not in r:
                series["train_loss"][it] = float(r["lm_loss"])
                if r.get("tokens_per_sec") is not None:
                    series["tokens_per_sec"][it] = float(r["tokens_per_sec"])
    return {k: sorted((i, v) for i, v in d.items() if math.isfinite(v)) for k, d in series.items()}


def labels_for(paths: list[str]) -> list[str]:
    """The file names, with as many parent directories as it takes to make them unique."""
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = [os.path.join(*p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(paths)


PANELS = [("train_loss", "training loss (lm loss)", True), ("valid_loss", "validation loss (lm loss)", True),
          ("tokens_per_sec", "throughput (tokens/s)", False)]


def plot(paths: list[str], output: str, title: str | None = None) -> dict:
    """Draw the runs into `output`; returns {label: series} as plotted."""
    plt, ext = _pyplot(output)
    runs = {label: load_run(p) for label, p in zip(labels_for(paths), paths)}
    if not any(s for run in runs.values() for s in run.values()):
        raise InputError(f"no training or validation records in {', '.join(paths)}")
    from matplotlib.ticker import FuncFormatter
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.5), sharex=True)
    for ax, (key, name, log_y) in zip(axes, PANELS):
        drawn = False
        for i, (label, run) in enumerate(runs.items()):
            points = run[key]
            if not points:
                continue
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=label, color=f"C{i}", marker="o" if len(points) < 30 else None, markersize=3)
            drawn = True
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.tick_params(labelbottom=True)
        ax.grid(True, alpha=0.3)
        if drawn:
            if log_y and all(v > 0 for run in runs.values() for _, v in run[key]):
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(plain)
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes, color="gray")
    if title:
        fig.suptitle(title)
    _save(plt, fig, output, ext)
    return runs


def load_timeline(path: str, iteration: int | None = None) -> dict:
    """The `pipeline_timeline` record of `iteration` (default: the last) in a JSONL log."""
    found = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and r.get("event") == "pipeline_timeline" and \
                    (iteration is None or r.get("iteration") == iteration):
                found = r
    if found is None:
        which = f"for iteration {iteration} " if iteration is not None else ""
        raise InputError(f"no pipeline_timeline record {which}in {path} (train with --log-pipeline-timeline)")
    return found


TIMELINE_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52"}


def plot_timeline(path: str, output: str, iteration: int | None = None, title: str | None = None) -> dict:
    """Draw one iteration's pipeline timeline into `output`; returns the record drawn."""
    plt, ext = _pyplot(output)
    record = load_timeline(path, iteration)
    ranks = record["ranks"]
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(ranks) + 1.5))
    end = max((e[4] for r in ranks for e in r["events"]), default=1.0)
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        for kind, chunk, mb, t0, t1 in r["events"]:
            ax.broken_barh([(t0, t1 - t0)], (y - 0.4, 0.8), facecolors=TIMELINE_COLOURS.get(kind, "gray"),
                           edgecolor="white", linewidth=0.5)
            if t1 - t0 > end / 80:
                ax.text((t0 + t1) / 2, y, f"{mb}" + ("'" if chunk else ""), ha="center", va="center", fontsize=6,
                        color="white")
        ax.text(end * 1.01, y, f"idle {100 * r['idle_fraction']:.0f}%", va="center", fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']} (pp {r['pp_rank']})" for r in reversed(ranks)])
    ax.set_xlim(0, end * 1.12)
    ax.set_xlabel("seconds from the iteration's first pass (bars: micro-batch; N' on chunk 1)")
    from matplotlib.patches import Patch
    kinds = sorted({e[0] for r in ranks for e in r["events"]}, key=list(TIMELINE_COLOURS).index)
    ax.legend(handles=[Patch(color=TIMELINE_COLOURS[k], label=k) for k in kinds], loc="upper left", fontsize=8,
              ncol=len(kinds))
    ax.set_title(title or f"pipeline timeline, iteration {record['iteration']} ({os.path.basename(path)})")
    _save(plt, fig, output, ext)
    return record


def _pyplot(output: str):
    """matplotlib.pyplot off-screen, and the image format of `output`."""
    try:
        import matplotlib
    except ImportError:
        raise MissingPackage("tools/plot_metrics.py needs matplotlib, which is not installed: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase
    ext = os.path.splitext(output)[1].lstrip(".").lower()
    if ext not in FigureCanvasBase.get_supported_filetypes():
        raise InputError(f"--output {output}: unknown image format {ext!r}; use one of "
                         f"{', '.join(sorted(FigureCanvasBase.get_supported_filetypes()))}")
    return plt, ext


def _save(plt, fig, output: str, ext: str) -> None:
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    try:
        with open(output, "xb") as f:  # "x": a file that appeared since the check is not overwritten either
            try:
                fig.savefig(f, format=ext, dpi=100)
            except BaseException:
                os.remove(output)  # no half-written picture
                raise
    except FileExistsError:
        raise InputError(_exists(output)) from None
    finally:
        plt.close(fig)


def _exists(output: str) -> str:
    return f"--output {output} already exists; nothing is overwritten: choose another file or remove it"


@cli(PROG)
def main(argv=None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="JSONL logs written by --log-jsonl")
    p.add_argument("--output", "-o", required=True, help="image to write (.png, .svg, .pdf); must not exist")
    p.add_argument("--title", help="figure title")
    p.add_argument("--timeline", action="store_true",
                   help="draw one run's pipeline timeline (--log-pipeline-timeline) instead of the curves")
    p.add_argument("--iteration", type=int, help="with --timeline: the iteration to draw (default: the last logged)")
    args = p.parse_args(argv)
    for path in args.runs:
        if not os.path.isfile(path):
            p.error(f"no such file: {path}")
    if os.path.lexists(args.output):  # before reading the logs (one of which it may be)
        p.error(_exists(args.output))
    if args.timeline:
        if len(args.runs) != 1:
            p.error("--timeline draws one run: give one RUN.jsonl")
        record = plot_timeline(args.runs[0], args.output, args.iteration, args.title)
        for r in record["ranks"]:
            print(f"rank {r['rank']} (pp {r['pp_rank']}): idle {100 * r['idle_fraction']:.1f}%")
        print(f"wrote {args.output}")
        return 0
    if args.iteration is not None:
        p.error("--iteration needs --timeline")
    runs = plot(args.runs, args.output, args.title)
    for label, run in runs.items():
        last = run["train_loss"][-1] if run["train_loss"] else None
        print(f"{label}: {len(run['train_loss'])} training points"
              + (f", last loss {last[1]:.4f} at iteration {last[0]}" if last else ""))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
