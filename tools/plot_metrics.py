#!/usr/bin/env python3
"""Plot the JSONL logs of one or more runs (pretrain_gpt.py --log-jsonl) side by side.

    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --output compare.png

Three panels against iterations: training loss, validation loss, throughput (tokens/s); one
line per run, labelled by its file name (by as much of its path as tells the runs apart).
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
    return runs


def _exists(output: str) -> str:
    return f"--output {output} already exists; nothing is overwritten: choose another file or remove it"


@cli(PROG)
def main(argv=None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="JSONL logs written by --log-jsonl")
    p.add_argument("--output", "-o", required=True, help="image to write (.png, .svg, .pdf); must not exist")
    p.add_argument("--title", help="figure title")
    args = p.parse_args(argv)
    for path in args.runs:
        if not os.path.isfile(path):
            p.error(f"no such file: {path}")
    if os.path.lexists(args.output):  # before reading the logs (one of which it may be)
        p.error(_exists(args.output))
    runs = plot(args.runs, args.output, args.title)
    for label, run in runs.items():
        last = run["train_loss"][-1] if run["train_loss"] else None
        print(f"{label}: {len(run['train_loss'])} training points"
              + (f", last loss {last[1]:.4f} at iteration {last[0]}" if last else ""))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
