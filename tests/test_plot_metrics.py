"""tools/plot_metrics.py: reads JSONL logs, draws runs side by side into a PNG."""
import json
import os
import sys

import pytest

from dist_helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plot_metrics  # noqa: E402
from megalite.errors import MissingPackage  # noqa: E402


def write_log(path, scale=1.0, tokens=1000.0, resumed=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"event": "memory_footprint", "ranks": []}]
    for it in (10, 20, 30, 40):
        lines.append({"iteration": it, "consumed_samples": it * 8, "lm_loss": scale * 8.0 / it ** 0.5,
                      "tokens_per_sec": tokens + it, "lr": 1e-3, "grad_norm": 1.0})
        if it % 20 == 0:
            lines.append({"iteration": it, "split": "valid", "lm_loss": scale * 9.0 / it ** 0.5, "ppl": 1.0})
    lines.append({"iteration": 40, "split": "test", "lm_loss": 0.1, "ppl": 1.1})
    if resumed:  # a resumed run appends iteration 40 again: the later record wins
        lines.append({"iteration": 40, "consumed_samples": 320, "lm_loss": 0.5, "tokens_per_sec": 5.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


def test_load_run(tmp_path):
    run = plot_metrics.load_run(write_log(tmp_path / "a.jsonl", resumed=True))
    assert [i for i, _ in run["train_loss"]] == [10, 20, 30, 40]
    assert run["train_loss"][0][1] == pytest.approx(8.0 / 10 ** 0.5) and run["train_loss"][-1][1] == 0.5
    assert run["valid_loss"] == [(20, pytest.approx(9.0 / 20 ** 0.5)), (40, pytest.approx(9.0 / 40 ** 0.5))]
    assert run["tokens_per_sec"][-1] == (40, 5.0)


def test_labels_tell_runs_apart():
    assert plot_metrics.labels_for(["/x/a/metrics.jsonl", "/x/b/metrics.jsonl"]) == ["a/metrics.jsonl",
                                                                                     "b/metrics.jsonl"]
    assert plot_metrics.labels_for(["/x/one.jsonl", "/y/two.jsonl"]) == ["one.jsonl", "two.jsonl"]


def test_plot_png_has_both_runs(tmp_path, capsys):
    import matplotlib.image
    import numpy as np
    a = write_log(tmp_path / "a" / "metrics.jsonl")
    b = write_log(tmp_path / "b" / "metrics.jsonl", scale=1.5, tokens=3000.0)
    out = tmp_path / "fig" / "compare.png"
    assert plot_metrics.main([a, b, "--output", str(out), "--title", "test"]) == 0
    assert "a/metrics.jsonl: 4 training points, last loss 1.2649 at iteration 40" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(out))[..., :3]
    assert img.shape[:2] == (450, 1800)  # three panels side by side

    def count(rgb):  # pixels of a line colour (matplotlib's C0 blue, C1 orange)
        return int((np.abs(img - np.array(rgb) / 255.0).max(axis=-1) < 0.05).sum())

    width = img.shape[1] // 3
    for panel in range(3):
        part = img[:, panel * width:(panel + 1) * width]
        blue = int((np.abs(part - np.array([31, 119, 180]) / 255.0).max(axis=-1) < 0.05).sum())
        orange = int((np.abs(part - np.array([255, 127, 14]) / 255.0).max(axis=-1) < 0.05).sum())
        assert blue > 50 and orange > 50, (panel, blue, orange)
    assert count((31, 119, 180)) > 200


def test_errors(tmp_path, monkeypatch, capsys):
    assert plot_metrics.main([str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "x.png")]) == 2
    assert "error: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1, "lm_loss": 2.0, "consumed_samples": 1}\nnot json\n')
    assert plot_metrics.main([str(bad), "--output", str(tmp_path / "x.png")]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingPackage, match="needs matplotlib.*pip install matplotlib"):
        plot_metrics.plot([write_log(tmp_path / "ok.jsonl")], str(tmp_path / "x.png"))


def test_existing_output_is_refused_and_kept(tmp_path, capsys):
    """An existing picture (or a log given as --output) is refused, byte for byte as it was."""
    log = write_log(tmp_path / "a.jsonl")
    out = tmp_path / "old.png"
    out.write_bytes(b"an earlier picture")
    assert plot_metrics.main([log, "--output", str(out)]) == 2
    assert f"error: --output {out} already exists; nothing is overwritten" in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier picture"
    before = open(log, "rb").read()
    assert plot_metrics.main([log, "--output", log]) == 2
    assert "already exists" in capsys.readouterr().err and open(log, "rb").read() == before
    with pytest.raises(plot_metrics.InputError, match="already exists"):  # appeared after main's check
        plot_metrics.plot([log], str(out))
    assert out.read_bytes() == b"an earlier picture"


def test_timeline_draws_one_row_per_rank_with_idle_gaps(tmp_path, capsys):
    """--timeline: a pipeline_timeline record (two ranks, rank 1 idle for its first half) becomes one
    row per rank, each pass a bar in its kind's colour, idle time blank, idle fractions printed."""
    import matplotlib.image
    import numpy as np
    events0 = [["F", 0, 0, 0.0, 1.0], ["F", 0, 1, 1.0, 2.0], ["B", 0, 0, 3.0, 4.0], ["W", 0, 0, 4.0, 5.0]]
    events1 = [["F", 0, 0, 2.5, 3.5], ["B", 0, 0, 3.5, 4.5], ["W", 0, 0, 4.5, 5.0]]
    record = {"event": "pipeline_timeline", "iteration": 3, "ranks": [
        {"rank": 0, "pp_rank": 0, "idle_fraction": 0.2, "events": events0},
        {"rank": 1, "pp_rank": 1, "idle_fraction": 0.5, "events": events1}]}
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"iteration": 3, "lm_loss": 1.0}) + "\n" + json.dumps(record) + "\n")
    out = tmp_path / "timeline.png"
    assert plot_metrics.main([str(log), "--timeline", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rank 0 (pp 0): idle 20.0%" in printed and "rank 1 (pp 1): idle 50.0%" in printed
    img = matplotlib.image.imread(str(out))[..., :3]

    def rows_with(hex_colour):
        rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
        return np.where((np.abs(img - rgb).max(axis=-1) < 0.03).sum(axis=1) > 20)[0]
    f_rows, w_rows = rows_with(plot_metrics.TIMELINE_COLOURS["F"]), rows_with(plot_metrics.TIMELINE_COLOURS["W"])
    assert len(f_rows) and len(w_rows)
    assert f_rows.max() - f_rows.min() > 30  # F bars on both rows
    assert plot_metrics.main([str(log), "--timeline", "--iteration", "9", "--output", str(tmp_path / "x.png")]) == 2
    assert "no pipeline_timeline record for iteration 9" in capsys.readouterr().err
