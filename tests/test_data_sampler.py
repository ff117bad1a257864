"""Sample order: a function of consumed_samples only, independent of the DP size."""
import pytest
import torch

from megalite.data.batch import build_batch
from megalite.data.samplers import PretrainingSampler


def global_batches(total, micro, dp, global_batch, consumed=0):
    """Samples of each global batch, gathered from every DP rank's micro-batches."""
    per_rank = [list(PretrainingSampler(total, consumed, micro, r, dp)) for r in range(dp)]
    steps = global_batch // (micro * dp)
    out = []
    for i in range(len(per_rank[0]) // steps):
        out.append(sorted(idx for r in range(dp) for mb in per_rank[r][i * steps:(i + 1) * steps] for idx in mb))
    return out


def test_global_batch_contents_do_not_depend_on_dp_size():
    ref = global_batches(96, micro=2, dp=1, global_batch=16)
    for dp in (2, 4, 8):
        assert global_batches(96, micro=2, dp=dp, global_batch=16) == ref
    assert ref[0] == list(range(16)) and ref[-1] == list(range(80, 96))


def test_resume_reads_what_an_uninterrupted_run_reads():
    full = [list(PretrainingSampler(100, 0, 3, r, 2)) for r in range(2)]
    for k in (6, 12, 48):
        resumed = [list(PretrainingSampler(100, k, 3, r, 2)) for r in range(2)]
        for r in range(2):
            assert resumed[r] == full[r][k // 6:]


def test_same_flags_same_order_every_time():
    a = list(PretrainingSampler(50, 4, 2, 1, 2))
    assert a == list(PretrainingSampler(50, 4, 2, 1, 2))
    assert a[0] == [6, 7]


def test_sampler_rejects_bad_input():
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="dp_rank"):
        PretrainingSampler(10, 0, 1, 2, 2)


def _megatron_masks(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's get_ltor_masks_and_position_ids, written as its loops (the reference)."""
    b, s = tokens.shape
    att = torch.tril(torch.ones(b, 1, s, s, dtype=torch.bool))
    loss_mask = torch.ones(b, s)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    pos = torch.arange(s).unsqueeze(0).repeat(b, 1)
    for i in range(b):
        eod_index = (tokens[i] == eod).nonzero().flatten().tolist()
        prev = 0
        for j in eod_index:
            if reset_attention_mask:
                att[i, 0, j + 1:, :j + 1] = False
            if reset_position_ids:
                pos[i, j + 1:] -= j + 1 - prev
                prev = j + 1
    return att, loss_mask, pos


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, False), (False, True, False), (False, False, True)])
def test_masks_and_positions_match_megatron(flags):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (3, 25), generator=g)  # id 0 is the eod: several documents per row
    batch = build_batch(tokens, 0, *flags)
    att, loss_mask, pos = _megatron_masks(tokens[:, :-1], 0, *flags)
    assert torch.equal(batch["labels"], tokens[:, 1:])
    assert torch.equal(batch["loss_mask"], loss_mask)
    assert torch.equal(batch["position_ids"], pos)
    if flags[1]:
        assert torch.equal(batch["attention_mask"].dense(), att)  # documents, never built densely by the loader
    else:
        assert batch["attention_mask"] is None
