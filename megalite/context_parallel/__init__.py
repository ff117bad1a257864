"""Context parallelism (CP): each rank of a CP group holds 1/c of every sequence, and attention
stays exact across the group.

Chunk order. A causal mask makes late queries cost more than early ones, so giving rank r the
r-th contiguous 1/c of the sequence would leave the last rank with most of the work. As
Megatron-LM's CP (and Liu et al. 2023's striped/zig-zag variants of ring attention), the
sequence is cut into 2·c chunks and rank r takes chunks r and 2c-1-r: every rank gets one early
and one late chunk, the same number of (query, key) pairs under the causal mask.

Attention, by --cp-comm-type (Megatron-LM's names and semantics; one type, or one per layer):
  - allgather (attention.py, megalite's default): every rank all-gathers the keys and values of the
    whole sequence (the kv heads, before GQA expands them), its local queries attend with a mask
    built from the global positions (causal, --window-size; same-document under
    --reset-attention-mask, from per-token document ids with no mask: model/varlen_attention.py,
    as under every type), and the all-gather's backward reduce-scatters dK/dV: the Llama 3 form
    (paper Sec. 3.3.2). Exact in one pass with any mask and any kernel that takes one; its cost
    is O(s) keys and values per rank per layer, and with an unfused kernel the [s/c, s] scores.
  - p2p (ring.py): ring attention (Liu et al. 2023): key/value blocks travel around the CP ring,
    partial outputs merge by their log-sum-exp, the backward runs the ring again with dK/dV
    travelling with the blocks. O(s/c) keys, values and no scores per rank; the causal load
    balance of the chunk order is kept by cutting each block to its allowed rows and columns.
  - a2a (ulysses.py): DeepSpeed-Ulysses: an all-to-all turns [s/c, heads] into [s, heads/c], the
    sequence is put back in order and attention runs as on one process over 1/c of the heads,
    an all-to-all turns the output back. Needs the heads to split over c (GQA kv heads are
    replicated when fewer than c).
  - a2a+p2p: --hierarchical-context-parallel-sizes A P (A·P = c): Ulysses within each group of A
    adjacent CP ranks, then the ring across the P groups (each ring member's keys are its a2a
    group's chunks).
Megatron-LM defaults to p2p; megalite keeps allgather as its default (the function is the same,
within rounding) because allgather alone runs attention dropout, softmax sinks and MLA under CP
(arguments/context_parallel.py refuses the others' gaps with one line). Memory per type:
planning/context_parallel.py. On gloo/CPU the ring posts the next block's transfer before
computing on the current one (forward); its backward passes blocks synchronously.

Beyond softmax attention: the gated DeltaNet layers (model/gated_delta_net.py) run Ulysses' all-
to-all whatever the type (the state runs through the sequence in order: each rank takes the whole
sequence of 1/c of the key heads), and DSA (model/dsa.py) runs on allgather's gathered keys, put in
sequence order for its top-k.

The gathered keys are laid out in rank order (rank 0's two chunks, then rank 1's, ...), not in
sequence order: instead of permuting them, the mask's columns follow the same order
(`gathered_positions`).
"""
