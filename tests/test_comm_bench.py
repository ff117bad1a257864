"""tools/comm_bench.py on 4 gloo ranks: every operation over every group of the layout, each
message size, its time and nccl-tests' bus bandwidth."""
import json
import os
import subprocess
import sys

from dist_helpers import ROOT

FACTOR = {"all_reduce": 2 * (2 - 1) / 2, "all_gather": (2 - 1) / 2, "reduce_scatter": (2 - 1) / 2, "send_recv": 1.0}


def test_comm_bench_reports_every_op_group_and_size(tmp_path):
    out = str(tmp_path / "bench.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(ROOT, "tools", "comm_bench.py"), "--tensor-model-parallel-size", "2", "--min-bytes", "1K",
           "--max-bytes", "16K", "--iters", "3", "--warmup", "1", "--json-out", out]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# tp group: 2 ranks" in proc.stdout and "# dp group: 2 ranks" in proc.stdout
    assert "# pp group: 1 rank in this layout" in proc.stdout
    # the pinned torch's gloo has the flat collectives (tests/test_comm.py): the bench says it ran them
    assert "# gloo: reduce_scatter and all_gather run as in-place all-reduces of the whole buffer" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert len(rows) == 2 * 4 * 5  # groups x ops x sizes, printed as size, count, op, time, algbw, busbw
    for size, count, op, t, algbw, busbw in rows:
        assert op in FACTOR and int(size) == 4 * int(count) and float(t) > 0
    records = [json.loads(line) for line in open(out)]
    assert sorted({r["bytes"] for r in records}) == [1024, 2048, 4096, 8192, 16384]
    assert {(r["group"], r["op"]) for r in records} == {(g, o) for g in ("tp", "dp") for o in FACTOR}
    for r in records:
        assert abs(r["algbw_gbps"] - r["bytes"] / r["time_us"] / 1e3) <= 1e-9 * r["algbw_gbps"] + 1e-12
        assert abs(r["busbw_gbps"] - r["algbw_gbps"] * FACTOR[r["op"]]) <= 1e-12


def test_comm_bench_refuses_one_process():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "comm_bench.py")], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 2 and "under torchrun" in proc.stderr


def test_default_sweep_suits_the_backend():
    import importlib.util
    spec = importlib.util.spec_from_file_location("comm_bench_under_test", os.path.join(ROOT, "tools", "comm_bench.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.build_parser().parse_args([]).max_bytes is None  # chosen by the backend
    assert tool.default_max_bytes("gloo") == 4 * 2**20 and tool.default_max_bytes("nccl") == 2**30


def test_existing_json_out_is_refused(tmp_path):
    import importlib.util

    import pytest

    from megalite.errors import InputError
    spec = importlib.util.spec_from_file_location("comm_bench_under_test", os.path.join(ROOT, "tools", "comm_bench.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "bench.jsonl"
    tool.check(tool.build_parser().parse_args(["--json-out", str(out)]), 2)  # a new file: fine
    out.write_text("an earlier run\n")
    with pytest.raises(InputError, match=f"--json-out {out} already exists; nothing is overwritten"):
        tool.check(tool.build_parser().parse_args(["--json-out", str(out)]), 2)
    assert out.read_text() == "an earlier run\n"
