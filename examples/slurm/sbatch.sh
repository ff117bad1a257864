#!/usr/bin/env bash
# Run one of the launch scripts in examples/ under SLURM: one srun task per node, each starting
# torchrun with that node's rank; node 0's address is the rendezvous point.
#
#   sbatch --nodes 16 examples/slurm/sbatch.sh examples/gpt3_13B.sh [pretrain_gpt.py flags...]
#   sbatch --nodes 128 --time 14-00:00:00 --export ALL,DATA_PATH=/data/pile_text_document \
#       examples/slurm/sbatch.sh examples/gpt3_175B.sh
#
# Requeue near the time limit (and, where the cluster allows it, after a node failure): the job
# comes back with the same command line and resumes from the latest checkpoint (--save D --load D):
#   sbatch --nodes 16 --requeue --signal=B:USR1@600 examples/slurm/sbatch.sh examples/gpt3_13B.sh
#
# Submit from the repository root (paths are taken relative to the submission directory). Every
# variable of examples/common.sh (DATA_PATH, TP, PP, MICRO_BATCH_SIZE, OUTPUT_DIR, ...) passes
# through the environment; NNODES, NODE_RANK, MASTER_ADDR and GPUS_PER_NODE come from SLURM.
# Outputs: the run's (log, checkpoints, TensorBoard) in OUTPUT_DIR [runs/<script>-<job id> of the
# submission directory]; SLURM's own log in %x-%j.out of the submission directory unless
# sbatch --output says otherwise. Nothing in the checkout, for instance:
#   sbatch --nodes 16 --output /scratch/run1/%x-%j.out --export ALL,OUTPUT_DIR=/scratch/run1 \
#       examples/slurm/sbatch.sh examples/gpt3_13B.sh
# Adjust the #SBATCH lines below (or override them on the sbatch command line) for your cluster.
#SBATCH --job-name=megalite
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

SCRIPT=${1:?usage: sbatch --nodes N examples/slurm/sbatch.sh examples/gpt3_<size>.sh [pretrain_gpt.py flags...]}
shift
cd "${SLURM_SUBMIT_DIR:-.}"
[ -f "$SCRIPT" ] || { echo "sbatch.sh: no such launch script: $SCRIPT (submit from the repository root)" >&2; exit 2; }

export NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export RUN_NAME=${RUN_NAME:-$(basename "${SCRIPT%.sh}")-${SLURM_JOB_ID:-local}}
echo "sbatch.sh: $SCRIPT on $NNODES node(s) x $GPUS_PER_NODE GPUs, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2

# --signal=B:USR1@N sends USR1 to this shell N seconds before the time limit: requeue the job
# (SLURM then stops the step and queues the job again; the next start resumes from a checkpoint)
trap 'echo "sbatch.sh: time limit near: requeueing job $SLURM_JOB_ID" >&2; scontrol requeue "$SLURM_JOB_ID"' USR1

# one task per node; SLURM_NODEID (0..NNODES-1) becomes torchrun's --node_rank. In the background,
# so that the trap runs while it works: wait returns early for a trapped signal, so wait again
srun --nodes "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 \
    bash -c 'NODE_RANK=$SLURM_NODEID exec bash "$0" "$@"' "$SCRIPT" "$@" &
SRUN=$!
status=0
while :; do
    wait "$SRUN" && { status=0; break; } || status=$?
    kill -0 "$SRUN" 2>/dev/null || break  # srun itself has ended (not a trapped signal)
done
exit "$status"
