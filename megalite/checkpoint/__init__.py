"""Checkpoints that resume exactly, on the layout that wrote them or any other, reading only
what each rank needs.

Layout on disk (Megatron-LM's directory names):

    DIR/latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    DIR/iter_0000100/metadata.json             iteration, consumed samples, arguments, model config,
                                               the layout that wrote it, scheduler and loss scaler,
                                               the spike guard's window
    DIR/iter_0000100/index.jsonl               the global index (native/index.py): the metadata
                                               again, and where every saved piece of every tensor is
    DIR/iter_0000100/rank_00003.safetensors    rank 3's tensors (native/tensor_file.py; nothing pickled)

Each saved tensor is a flat range [lo, hi) of one parameter's *local shard* (of the weight, its
fp32 master, or an optimizer moment), recorded with how that shard was cut from the whole
tensor (TP partition dimension, stride, TP size, the real vocabulary rows of padded tables).
Which rank saves what ("ownership", `owned_pieces`): with the distributed optimizer every rank
its own slices (ZeRO-1/2/3) of parameters, masters and moments; with the plain optimizer whole
parameters spread over the data-parallel ranks by size, so DP replicas write (and read) disjoint,
about equal parts in parallel. A TP-replicated tensor is saved by TP rank 0 only.
Every element is saved once, plus the last pipeline stage's optimizer state for its copy of the
tied embedding (so that stage never reads the first stage's files).

Loading applies the same ownership rule to the *new* layout: each rank reads the elements it
owns there, from the saved pieces that overlap them (byte ranges computed by native/reshard.py, read
with pread), and the rest arrives by summing over the group where the others hold zeros: TP for
TP-replicated tensors, DP for parameters (and for the plain optimizer's state; not under ZeRO-3,
where a rank stores only its own slices of the parameters), the embedding group for the tied
copy. On the layout that saved it a rank therefore reads exactly its own
file, plus the index header and its sections; on another layout, only the saved pieces that
overlap what it owns. Each rank counts the bytes it read and the files it opened
(`LoadStats`; the loop writes one `checkpoint_load` JSONL record per rank).

Saves are atomic: files go to `iter_N.tmp`, which is renamed once every rank has finished, and
only then does the latest pointer move, so a run killed mid-save leaves the previous checkpoint
as the latest. `async_save` copies the tensors to host memory, writes them from a thread while
training goes on, and finalises at a later iteration. With `check_finite` (the default), a
save whose weights or optimizer state hold a NaN or an Inf is refused on every rank.

Modules, by floor (docs/architecture.md; tests/test_import_graph.py's FLOORS): paths.py, the
names on disk every format shares; native/, megalite's own format (state.py: what a rank saves,
TrainState, ownership, shard layouts, RNG; save.py, index.py, reshard.py, tensor_file.py, and
region.py, the one reader of saved pieces); hf/, Hugging Face interchange; megatron/, Megatron-LM's
torch_dist (format.py, names.py, index.py; export.py and saver.py write it, to_hf.py streams it to
Hugging Face) and legacy torch (legacy.py) formats, and the allow-list unpickler (safe_pickle.py);
above the families, what opens any format: files.py (the up-front checks), load.py and offline.py
(whole-model state in one process, for the converters and generation); and upcycling/. This
package's __init__ imports none of them: `import megalite.checkpoint.files` stays free of torch.
"""
