"""Packed documents (--reset-attention-mask, --reset-position-ids, --eod-mask-loss) train exactly as
the same documents run one per row, without any [s, s] mask (model/varlen_attention.py).

Real text: pieces of the bundled corpus's documents (each ending in its end-of-document token)
packed back to back into rows of --seq-length tokens, against a batch that holds each piece alone
in its own row (padded after it with end-of-document tokens, whose loss --eod-mask-loss drops).
Every token then has the same context, positions and label in both batches, so the per-token
losses agree at every step of a few SGD steps (token-mean loss: the gradients are the same sum),
on one process and, in one 2-rank pool run, under CP 2 with each --cp-comm-type (allgather,
p2p ring, a2a Ulysses; documents crossing the ranks' chunks) and TP 2. RoPE, GQA and a sliding-window layer are on. pretrain_gpt.py with the document flags
trains the same on PP 2 as on one process.
"""
import numpy as np
import pytest
import torch

from dist_helpers import assert_loss_falls, assert_losses_close, grad_norms, run_pretrain, spawn, train_losses
from megalite.data.batch import build_batch
from megalite.data.indexed_dataset import IndexedDataset
from tiny import tiny

S, ROWS, STEPS, LR = 64, 2, 4, 0.3


def pack(prefix: str):
    """(packed tokens [ROWS, S + 1], one-per-row tokens [docs, S + 1], where [ROWS, S] -> (doc, offset))."""
    data = IndexedDataset(prefix)
    eod = int(data.get(0)[-1])  # preprocess_data.py --append-eod
    rng = np.random.default_rng(0)
    packed, single, where, doc = [], [], [], 0
    for _ in range(ROWS):
        stream, row_where = [], []
        while len(stream) < S + 1:
            text = data.get(doc)
            n = min(int(rng.integers(5, 30)), len(text) - 1)
            piece = ([int(t) for t in text[:n]] + [eod])[:S + 1 - len(stream)]  # the last piece is cut
            row_where += [(len(single), o) for o in range(len(piece))]
            single.append(piece + [eod] * (S + 1 - len(piece)))
            stream += piece
            doc += 1
        packed.append(stream)
        where.append(row_where[:S])
    packed, single, where = torch.tensor(packed), torch.tensor(single), torch.tensor(where)
    # the same (token, label) pairs count in both: a cut last piece's final token is an input
    # only in its own row (in the packed row it is the last label)
    single_mask = torch.zeros(single.size(0), S)
    single_mask[where[..., 0], where[..., 1]] = (packed[:, :-1] != eod).float()
    return packed, (single, single_mask), where, eod


def _train(tokens, eod, tp_group=None, cp_group=None, loss_mask=None, cp_comm_type="allgather"):
    """Per-token losses ([b, s] or this CP rank's [b, s/c]) and loss masks at each of STEPS SGD steps."""
    from megalite import comm
    from megalite.context_parallel.sharding import slice_batch
    from megalite.model import ExecutionConfig, GPTConfig, GPTModel
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=512,
                    padded_vocab_size=512, seq_length=S, max_position_embeddings=S, hidden_dropout=0.0,
                    attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                    window_size="7,0", window_attn_skip_freq="2")
    batch = build_batch(tokens, eod, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    whole = batch["loss_mask"].sum()
    batch = slice_batch(batch, comm.group_size(cp_group), comm.group_rank(cp_group))
    model = GPTModel(cfg, tp_group=tp_group, cp_group=cp_group,
                     execution=ExecutionConfig(cp_comm_type=(cp_comm_type,)))
    model.initialize(5)
    losses = []
    for _ in range(STEPS):
        model.zero_grad()
        loss = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], batch["labels"])
        ((loss * batch["loss_mask"]).sum() / whole).backward()
        losses.append(loss.detach())
        with torch.no_grad():
            for p in model.parameters():
                if cp_group is not None:  # each CP rank holds part of every sequence's gradient
                    comm.all_reduce(p.grad, cp_group)
                p -= LR * p.grad
    return torch.stack(losses), batch["loss_mask"]


def _layouts(rank, world, packed, single, eod):
    import torch.distributed as dist

    from megalite.context_parallel.sharding import chunk_positions
    group = dist.group.WORLD
    out = {"tp2": (_train(packed, eod, tp_group=group)[0], None)}
    for comm_type in ("allgather", "p2p", "a2a"):
        full = torch.zeros(STEPS, *packed[:, :-1].shape)  # back to sequence order, the other chunks 0
        full[:, :, chunk_positions(S, world, rank)] = _train(packed, eod, cp_group=group, cp_comm_type=comm_type)[0]
        out[f"cp2 {comm_type}"] = (full, chunk_positions(S, world, rank))
    if rank == 0:
        out["one process"] = (_train(packed, eod)[0], None)
        out["one per row"] = _train(single[0], eod, loss_mask=single[1])
    return out


@pytest.fixture(scope="module")
def runs(corpus):
    packed, single, where, eod = pack(corpus[corpus.index("--data-path") + 1])
    return spawn(_layouts, 2, packed, single, eod), where


def test_packed_rows_hold_several_documents(runs):
    _, where = runs
    assert all(len(set(where[r, :, 0].tolist())) >= 3 for r in range(ROWS))


@pytest.mark.parametrize("layout", ["one process", "cp2 allgather", "cp2 p2p", "cp2 a2a", "tp2"])
def test_packed_documents_train_as_one_per_row(runs, layout):
    results, where = runs
    single_losses, single_mask = results[0]["one per row"]
    reference = single_losses[:, where[..., 0], where[..., 1]]  # [steps, ROWS, S] in packed order
    counted = single_mask[where[..., 0], where[..., 1]].bool()
    assert counted.float().mean() > 0.8
    ref_mean = reference[:, counted].mean(1)
    assert ref_mean[-1] < 0.8 * ref_mean[0], ref_mean  # the loss falls: it trains
    if layout.startswith("cp2"):
        losses = sum(r[layout][0] for r in results)  # each rank's chunks in their places
        assert sorted(torch.cat([r[layout][1] for r in results]).tolist()) == list(range(S))
    else:
        losses = results[0][layout][0]
    torch.testing.assert_close(losses[:, counted], reference[:, counted], rtol=1e-4, atol=1e-5)


def test_pipeline_trains_packed_documents_as_one_process(corpus, tmp_path):
    """pretrain_gpt.py with the three document flags on PP 2 (every stage attends by the loader's
    document ids) equals one process: loss and gradient norm per iteration, on the corpus."""
    flags = corpus + tiny(seq_length=64, train_iters=4, log_interval=1, lr=3e-3, eval_iters=0) + [
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--adam-eps", "1e-4",
        "--position-embedding-type", "rope", "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
    ref, _ = run_pretrain(1, flags, tmp_path, "one")
    pp2, _ = run_pretrain(2, flags + ["--pipeline-model-parallel-size", "2"], tmp_path, "pp2")
    assert_loss_falls(train_losses(ref), 0.1)
    assert_losses_close(train_losses(ref), train_losses(pp2), rtol=1e-5)
    assert_losses_close(grad_norms(ref), grad_norms(pp2), rtol=1e-5)
