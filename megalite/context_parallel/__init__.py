"""Context parallelism (CP): each rank of a CP group holds 1/c of every sequence, and attention
stays exact across the group.

Chunk order. A causal mask makes late queries cost more than early ones, so giving rank r the
r-th contiguous 1/c of the sequence would leave the last rank with most of the work. As
Megatron-LM's CP (and Liu et al. 2023's striped/zig-zag variants of ring attention), the
sequence is cut into 2·c chunks and rank r takes chunks r and 2c-1-r: every rank gets one early
and one late chunk, the same number of (query, key) pairs under the causal mask.

Attention. Every rank all-gathers the keys and values of the whole sequence (forward), computes
exact softmax(Q·Kᵀ)·V of its local queries against all keys with a mask built from the global
positions (causal, and same-document under --reset-attention-mask), and the all-gather's
backward reduce-scatters dK/dV back to their owners. This is the all-gather form of CP used for
Llama 3 (Llama 3 paper, Sec. 3.3.2; Megatron-LM's cp_comm_type "all_gather"), chosen over ring
attention with online softmax (Liu et al. 2023; Megatron-LM's "p2p") because:
  - it is exact in one pass with any mask: document masks (--reset-attention-mask) need no
    per-step block bookkeeping, and any attention kernel that takes a mask works unchanged;
  - GQA stays simple and cheap: the kv heads are gathered before they are expanded, so the
    traffic is 2·s·g·hn per layer, not 2·s·n·hn;
  - on gloo/CPU there is no compute to overlap a ring's sends with, so the ring's one real
    advantage (overlap, O(s/c) K/V memory) buys nothing here.
Its cost: O(s) keys and values per rank per layer (not O(s/c)); every other activation (the
[s/c, b, h] residual stream, MLP, norms, logits, the [s/c, s] scores) still divides by c.

The gathered keys are laid out in rank order (rank 0's two chunks, then rank 1's, ...), not in
sequence order: instead of permuting them, the mask's columns follow the same order
(`gathered_positions`).
"""
