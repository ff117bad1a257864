#!/usr/bin/env python3
"""Pretrain a GPT model: one process (`python pretrain_gpt.py ...`) or many
(`torchrun --nproc_per_node N pretrain_gpt.py ...`). Flags follow Megatron-LM; see --help.

Bad input (a flag, a missing or corrupt file, a checkpoint of another model) ends with one line
`pretrain_gpt.py: error: ...` on stderr and exit status 2; a traceback means a bug."""
import sys

from megalite.errors import cli


@cli("pretrain_gpt.py")
def main(argv=None) -> int:
    from megalite.arguments import parse_config
    config = parse_config(argv)  # every flag and file, before torch.distributed starts
    if config.training.dry_run:  # this rank built and stepped on the meta device, its bytes reported
        from megalite.dry_run import main as dry_run
        dry_run(config)
        return 0
    if config.resilience.inprocess_restart:  # under python -m megalite.inprocess: restarts in this process
        from megalite.inprocess.worker import train_restarting
        train_restarting(config)
        return 0
    from megalite.training import pretrain
    pretrain(config)  # typed configs from here on
    return 0


if __name__ == "__main__":
    sys.exit(main())
