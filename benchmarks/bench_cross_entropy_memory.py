"""Peak memory of the vocabulary-parallel cross entropy (forward, then forward + backward) over
the memory resident before it, for [2048, 4, 32768] logits with 1000 padded columns, one process.
Compare with an older implementation by passing its file:

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/bench_cross_entropy_memory.py new bfloat16
    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/bench_cross_entropy_memory.py old_ce.py bfloat16

(mmap threshold pinned so freed buffers go back to the OS and the peak RSS, VmHWM reset through
/proc/self/clear_refs, measures what was held at once; Linux only). Results in
benchmarks/RESULTS_throughput.md.
"""
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)
which, dtype = sys.argv[1], getattr(torch, sys.argv[2])
if which != "new":
    spec = importlib.util.spec_from_file_location("other_ce", which)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    fn = m.vocab_parallel_cross_entropy
else:
    from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy as fn


def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])


V = 32768
x = torch.randn(2048, 4, V).to(dtype).requires_grad_()
t = torch.randint(0, V - 1000, (2048, 4))
fn(x[:1], t[:1], None, V - 1000).sum().backward()  # warm-up
x.grad = None
open("/proc/self/clear_refs", "w").write("5")
base = kib("VmRSS")
loss = fn(x, t, None, V - 1000)
fwd = kib("VmHWM") - base
loss.sum().backward()
tot = kib("VmHWM") - base
print(which, dtype, f"logits {x.numel() * x.element_size() / 2**20:.0f} MiB; peak over start: "
      f"forward {fwd / 1024:.0f} MiB, forward+backward {tot / 1024:.0f} MiB")
