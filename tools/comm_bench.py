#!/usr/bin/env python3
"""Latency and bus bandwidth of megalite's collectives over the TP, PP and DP groups of a layout,
reported as nccl-tests reports them.

    torchrun --nproc_per_node 8 tools/comm_bench.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 [--min-bytes 1K --max-bytes 1G] [--ops all_reduce,send_recv]

Every group of a kind runs at once (as in training: all TP groups reduce together). For a message
of S bytes over a group of n ranks and t seconds per operation (the slowest rank's average):

    algbw = S / t,    busbw = algbw * factor,    factor = 2(n-1)/n  all-reduce
                                                          (n-1)/n   all-gather, reduce-scatter
                                                          1         send/recv

where S is the whole buffer (the gathered output, the scattered input), and in send/recv each
rank sends S to the next rank of its group and receives S from the previous one (nccl-tests,
doc/PERFORMANCE.md). busbw compares with the link's peak whatever n is. The operations are the
ones training uses (megalite/comm.py): on gloo the flat reduce-scatter and all-gather run as
in-place all-reduces of the whole buffer (it says so), NCCL's run its own.

Sizes: --min-bytes to --max-bytes, by --step-factor; --max-bytes defaults to 1G with NCCL and
4M with gloo (gloo on CPU moves a few GB/s at best: a 1 GB sweep over every op and group would
take many minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.errors import ArgumentParser, InputError, cli  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
GROUPS = ("tp", "pp", "dp")
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}


def parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().rstrip("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 1024, 64K, 16M or 1G, got {text!r}") from None


def default_max_bytes(backend: str) -> int:
    """The sweep's largest message when --max-bytes is not given: 1 GB over NCCL (nccl-tests'
    usual range), 4 MB over gloo (CPU links; beyond that a sweep of every op and group takes minutes)."""
    return parse_bytes("1G" if backend == "nccl" else "4M")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="comm_bench.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--use-tp-pp-dp-mapping", action="store_true", help="rank order TP-PP-DP instead of TP-DP-PP")
    p.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl with CUDA, gloo without")
    p.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"), help="smallest message (1K, 4M, ...)")
    p.add_argument("--max-bytes", type=parse_bytes, default=None,
                   help="largest message (default: 1G with nccl, 4M with gloo)")
    p.add_argument("--step-factor", type=int, default=2, help="each message this many times the previous")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--groups", default=",".join(GROUPS), help="comma-separated, of tp, pp, dp")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=20, help="timed operations per message size")
    p.add_argument("--warmup", type=int, default=5, help="untimed operations first")
    p.add_argument("--json-out", help="also write one JSON line per measurement here (rank 0); must not exist")
    return p


def check(args, world: int) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world < 2:
        raise InputError("comm_bench.py measures collectives between processes: run it under torchrun with "
                         "--nproc_per_node >= 2")
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise InputError(f"world size {world} is not divisible by --tensor-model-parallel-size ({tp}) x "
                         f"--pipeline-model-parallel-size ({pp})")
    if args.min_bytes < 1 or (args.max_bytes is not None and args.max_bytes < args.min_bytes):
        raise InputError(f"need 1 <= --min-bytes ({args.min_bytes}) <= --max-bytes ({args.max_bytes})")
    if args.step_factor < 2 or args.iters < 1 or args.warmup < 0:
        raise InputError("--step-factor must be >= 2, --iters >= 1 and --warmup >= 0")
    for flag, values, allowed in (("--ops", args.ops, OPS), ("--groups", args.groups, GROUPS)):
        bad = [v for v in values.split(",") if v not in allowed]
        if bad:
            raise InputError(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    if not args.distributed_timeout_minutes > 0:
        raise InputError("--distributed-timeout-minutes must be > 0")
    if args.json_out and os.path.lexists(args.json_out):
        raise InputError(f"--json-out {args.json_out} already exists; nothing is overwritten: choose another file "
                         "or remove it")


def run_op(op: str, group, ranks: list[int], buf, out, rank_in_group: int) -> None:
    import torch.distributed as dist

    from megalite import comm
    n = len(ranks)
    if op == "all_reduce":
        comm.all_reduce(buf, group)
    elif op == "all_gather":
        comm.all_gather_flat(buf.view(n, -1)[rank_in_group], buf, group)
    elif op == "reduce_scatter":
        comm.reduce_scatter_flat(buf, out, group)
    else:
        nxt, prev = ranks[(rank_in_group + 1) % n], ranks[(rank_in_group - 1) % n]
        comm.exchange([dist.P2POp(dist.isend, buf, nxt), dist.P2POp(dist.irecv, out, prev)])


def measure(op, group, ranks, nbytes, dtype, device, args) -> tuple[int, float]:
    """(bytes actually moved, seconds per operation on the slowest rank)."""
    import torch
    import torch.distributed as dist

    from megalite import comm
    n, me = len(ranks), ranks.index(dist.get_rank())
    esize = torch.empty((), dtype=dtype).element_size()
    count = max(nbytes // esize, n)
    if op in ("all_gather", "reduce_scatter"):
        count -= count % n  # the buffer splits into n equal shards
    buf = torch.ones(count, dtype=dtype, device=device)
    out = torch.empty(count // n if op == "reduce_scatter" else count, dtype=dtype, device=device)
    if op == "reduce_scatter" and dist.get_backend(group) == "gloo":
        out = buf.view(n, -1)[me]  # in place, as the distributed optimizer uses it
    for _ in range(args.warmup):
        run_op(op, group, ranks, buf, out, me)
    comm.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        run_op(op, group, ranks, buf, out, me)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64, device=device)
    comm.all_reduce(t, comm.world_group(), op=dist.ReduceOp.MAX)
    return count * esize, float(t.item())


@cli("comm_bench.py")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check(args, world)
    import torch
    import torch.distributed as dist

    from megalite import comm, parallel_state
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise InputError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    comm.init_distributed(backend, args.distributed_timeout_minutes, device_id=device if backend == "nccl" else None)
    order = "tp-pp-dp" if args.use_tp_pp_dp_mapping else "tp-dp-pp"
    ps = parallel_state.initialize(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, 1, order,
                                   timeout_minutes=args.distributed_timeout_minutes)
    dtype = getattr(torch, args.dtype)
    lead = dist.get_rank() == 0
    out = open(args.json_out, "x") if lead and args.json_out else None  # "x": checked above, never overwritten

    def say(line=""):
        if lead:
            print(line, flush=True)

    say(f"# megalite comm_bench: {ps.describe()}, backend {backend}, {args.dtype}, {args.iters} iterations "
        f"({args.warmup} warm-up) per size")
    say("# time: the slowest rank's average; busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, "
        "reduce_scatter), 1 (send_recv)")
    if backend == "gloo":
        say("# gloo: reduce_scatter and all_gather run as in-place all-reduces of the whole buffer, as training "
            "does (gloo's own copy it through a temporary as large as the buffer; comm.flat_by_all_reduce)")
    max_bytes = args.max_bytes if args.max_bytes is not None else default_max_bytes(backend)
    sizes, s = [], args.min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= args.step_factor
    groups = {"tp": (ps.tp_group, ps.tp_ranks), "pp": (ps.pp_group, ps.pp_ranks), "dp": (ps.dp_group, ps.dp_ranks)}
    for kind in args.groups.split(","):
        group, ranks = groups[kind]
        n = len(ranks)
        say()
        if n < 2:
            say(f"# {kind} group: 1 rank in this layout, nothing to measure")
            continue
        say(f"# {kind} group: {n} ranks (rank 0's: {ranks}; {world // n} groups at once)")
        say(f"# {'size(B)':>12} {'count':>11}  {'op':<15}{'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
        for op in args.ops.split(","):
            for size in sizes:
                nbytes, t = measure(op, group, ranks, size, dtype, device, args)
                algbw = nbytes / t / 1e9
                busbw = algbw * FACTOR[op](n)
                say(f"  {nbytes:>12} {nbytes // dtype.itemsize:>11}  {op:<15}{t * 1e6:>11.1f} {algbw:>12.3f} "
                    f"{busbw:>12.3f}")
                if out is not None:
                    out.write(json.dumps({"group": kind, "group_size": n, "op": op, "bytes": nbytes, "time_us": t * 1e6,
                                          "algbw_gbps": algbw, "busbw_gbps": busbw, "backend": backend,
                                          "dtype": args.dtype}) + "\n")
    if out is not None:
        out.close()
    comm.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
