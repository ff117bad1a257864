"""--bf16 on a CPU without AVX512-BF16 / AMX warns once at start-up; fp32, or a CPU with them, does not."""
import torch

from megalite.runtime import cpu

NO_BF16 = frozenset({"fpu", "sse2", "avx2", "fma"})
AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


def test_warning_only_for_bf16_on_cpu_without_native_bf16():
    msg = cpu.slow_bf16_warning("cpu", torch.bfloat16, NO_BF16)
    assert msg is not None and "slower than fp32" in msg and "AMX" in msg
    assert cpu.slow_bf16_warning("cpu", torch.bfloat16, AMX) is None
    assert cpu.slow_bf16_warning("cpu", torch.bfloat16, frozenset({"avx512_bf16"})) is None
    assert cpu.slow_bf16_warning("cpu", torch.float32, NO_BF16) is None
    assert cpu.slow_bf16_warning("cuda", torch.bfloat16, NO_BF16) is None


def test_reads_this_machines_flags():
    flags = cpu.cpu_flags()
    if flags:  # Linux x86: the answer follows /proc/cpuinfo
        assert cpu.cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_printed_once_at_start_up(monkeypatch, capsys):
    from megalite.arguments import parse_args, validate_args
    from megalite.training import setup
    flags = ["--mock-data", "--vocab-size", "100", "--num-layers", "1", "--hidden-size", "32",
             "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
             "--lr", "1e-3", "--eval-iters", "0"]
    monkeypatch.setattr(cpu, "cpu_flags", lambda: NO_BF16)  # a CPU without native bf16
    for extra, expected in ((["--bf16"], 1), ([], 0)):
        setup(validate_args(parse_args(flags + extra), 1))
        assert capsys.readouterr().out.count("WARNING: --bf16 on a CPU without") == expected, extra
    monkeypatch.setattr(cpu, "cpu_flags", lambda: AMX)
    setup(validate_args(parse_args(flags + ["--bf16"]), 1))
    assert "WARNING: --bf16" not in capsys.readouterr().out
