"""torchrun, with a refused run reported as one process reports it.

    python -m megalite.launch --standalone --nproc_per_node 4 pretrain_gpt.py ...

takes torchrun's arguments and runs torchrun's own launcher (torch.distributed.run), so restarts,
rendezvous and signals are torchrun's. One difference: when the workers refused their input
(a worker exited with status 2, as megalite's entry points and argparse do for bad usage, and
every other failed worker did too or was stopped by a signal, as torchrun stops the rest), the
`error:` line the workers printed is the report: no ChildFailedError traceback (torchrun's log
lines about the failed and stopped workers remain), and exit status 2. Any other failure is
reported exactly as torchrun reports it (its traceback and summary, exit status 1).

Plain torchrun cannot do this: its agent turns every failed worker into a traceback and status 1.
"""
from __future__ import annotations

import sys

from .errors import EXIT_USER_ERROR


def refused(failures: dict) -> bool:
    """Whether a failed job's workers refused their input: {rank: ProcessFailure} of
    ChildFailedError, one of which exited with status 2 and every other with status 2 or by a
    signal (a worker torchrun stopped once another had failed)."""
    codes = [f.exitcode for f in failures.values()]
    return EXIT_USER_ERROR in codes and all(c == EXIT_USER_ERROR or c < 0 for c in codes)


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import parse_args, run

    @record  # as torchrun's own main: other failures keep torchrun's report and error file
    def launch():
        try:
            run(parse_args(argv))
        except ChildFailedError as e:
            if refused(e.failures):
                raise SystemExit(EXIT_USER_ERROR) from None  # the workers printed why
            raise

    launch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
