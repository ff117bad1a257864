"""python -m megalite.inprocess --nproc-per-node N pretrain_gpt.py --inprocess-restart ... (launcher.py)"""
import sys

from .launcher import main

sys.exit(main())
