"""In-process restart (--inprocess-restart): a dead or frozen rank costs seconds, not a job restart.

torchrun stops every worker when one dies, so the survivors' state dies with them. Here a launcher
of megalite's own (`python -m megalite.inprocess`, launcher.py) hosts the key-value store, starts
the workers (and warm spares), watches their processes and heartbeats (heartbeat.py), kills a
frozen one (SIGKILL: on gloo a stopped peer blocks its collectives until their timeout, a dead
one makes them raise at once), and publishes the next *generation*: which process is which rank
(membership.py). Each worker (worker.py) runs `pretrain` in a loop: when a collective fails, it
destroys its process groups, waits for the next generation, builds new groups through a store
prefix of that generation, and runs `pretrain` again in the same process (no torch re-import,
no disk read), which restores every rank from the newest --non-persistent-ckpt-type in_memory
snapshot (checkpoint/native/memory.py): its own, or for the replacement, the copy its replica
peer holds. This is Megatron-LM's in-process restart (nvidia-resiliency-ext's inprocess.Wrapper)
reduced to what a gloo job on one node needs: one rank replaced at a time (NCCL is refused:
a dead peer hangs its collectives until NCCL's watchdog ends the process).
"""
