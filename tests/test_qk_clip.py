"""--qk-clip (Kimi K2's QK-clip, Megatron-LM's flags): the per-head largest logit against the
scores written out, the clip against the rescaling written out in the test, and every parallel
layout training as one process with clipping active (the largest logit passes the threshold), under
Muon (MuonClip: --muon-tp-mode distributed on the MoE layouts, duplicated on the dense ZeRO-2 one)."""
import math

import pytest
import torch

from dist_helpers import assert_layout_matches, assert_loss_falls, per_iteration, run_reference, train_losses
from megalite.model import max_logit
from megalite.model.attention import SelfAttention
from megalite.model.config import model_configs
from megalite.model.max_logit import MaxLogitTracker
from megalite.context_parallel.documents import Documents
from megalite.optimizer.qk_clip import QKClip
from tiny import tiny


def reference_maxima(q, k, mask):
    """[n] per-head max of q·k/√d over allowed (query, key) pairs: the whole score matrix."""
    s, b, n, hn = q.shape
    kb = k.repeat_interleave(n // k.size(2), dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, kb) / math.sqrt(hn)
    if mask is None:
        mask = torch.ones(s, k.size(0), dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    return scores.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", "bool-2d", "documents"])
def test_tracker_matches_the_written_out_scores_in_chunks(monkeypatch, mask_kind):
    torch.manual_seed(0)
    s, b, n, g, hn = 12, 2, 4, 2, 8
    q, k = torch.randn(s, b, n, hn), torch.randn(s, b, g, hn)
    allowed = torch.rand(b, 1, s, s) > 0.3
    allowed[..., 0] = True  # every query sees a key
    mask = {"causal": None, "bool": allowed,
            "additive": torch.zeros(b, 1, s, s).masked_fill(~allowed, float("-inf")), "bool-2d": allowed[0, 0]}.get(mask_kind)
    if mask_kind == "documents":  # packed documents (--reset-attention-mask): ids, keys in a CP-like order
        order = torch.cat([torch.arange(0, 6), torch.arange(6, 12).flip(0)])
        documents = Documents(torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3]), order, order.flip(0))
        tracker = MaxLogitTracker(n)
        monkeypatch.setattr(max_logit, "CHUNK_ELEMENTS", b * n * s * 5)
        tracker.observe(q, k, documents)
        torch.testing.assert_close(tracker.value, reference_maxima(q, k, documents.dense()), rtol=1e-6, atol=1e-6)
        return
    monkeypatch.setattr(max_logit, "CHUNK_ELEMENTS", b * n * s * 5)  # blocks of 5 query rows: 3 chunks
    tracker = MaxLogitTracker(n)
    tracker.observe(q, k, mask)
    torch.testing.assert_close(tracker.value, reference_maxima(q, k, mask), rtol=1e-6, atol=1e-6)
    tracker.observe(q, k, mask)  # a recomputed forward: the same maxima, not more
    torch.testing.assert_close(tracker.value, reference_maxima(q, k, mask), rtol=1e-6, atol=1e-6)
    tracker.observe(q * 0.5, k, mask)  # a smaller micro-batch leaves the step's maximum
    torch.testing.assert_close(tracker.value, reference_maxima(q, k, mask), rtol=1e-6, atol=1e-6)


class _OneRank:
    dp_cp_group = mp_group = None


def test_clip_rescales_query_and_key_rows_of_groups_past_the_threshold():
    """GQA (4 heads, 2 groups), alpha 0.3: η_g = τ / S_g for groups past τ; their query rows ×
    η^α, key rows × η^(1-α), value rows and other groups untouched; the logits then peak at τ."""
    torch.manual_seed(1)
    config, execution = model_configs(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                      kv_channels=8, ffn_hidden_size=64, vocab_size=64, seq_length=16,
                                      group_query_attention=True, add_bias_linear=False)
    attention = SelfAttention(config, execution, tp_group=None).train()
    torch.nn.init.normal_(attention.linear_qkv.weight, std=0.5)
    opt = type("Opt", (), {"qk_clip_threshold": 0.0, "qk_clip_alpha": 0.3})()
    clip = QKClip([attention], opt, _OneRank(), torch.device("cpu"))
    x = torch.randn(16, 2, 32)
    with torch.no_grad():
        attention(x)
    maxima = attention.max_logits.value.clone()
    grouped = maxima.view(2, 2).amax(dim=1)
    clip.threshold = float(grouped.min() + grouped.max()) / 2  # one group past it, one not
    before = attention.linear_qkv.weight.detach().clone()
    scales = clip.prepare()
    assert clip.max_logit == pytest.approx(float(maxima.max()))
    w = attention.linear_qkv.weight
    clip.apply([(w, 0, 100, w.view(-1)[:100]), (w, 100, w.numel(), w.view(-1)[100:])], scales)  # a cut piece
    expected = before.view(2, 4, 8, 32).clone()  # [groups, (2 queries, key, value), hn, h]
    for gi in range(2):
        if grouped[gi] > clip.threshold:
            eta = clip.threshold / float(grouped[gi])
            expected[gi, :2] *= eta ** 0.3
            expected[gi, 2] *= eta ** 0.7
    torch.testing.assert_close(w.detach(), expected.view_as(w), rtol=1e-6, atol=0)
    assert attention.max_logits.value is None  # the next step starts again
    with torch.no_grad():
        attention(x)
    after = attention.max_logits.value.view(2, 2).amax(dim=1)
    torch.testing.assert_close(after, grouped.clamp(max=clip.threshold), rtol=1e-5, atol=0)


# -- every layout as one process, clipping active --------------------------------------------------
THRESHOLD = 0.15
ITERS = 5
MODEL = tiny(num_layers=2, lr=1e-2, train_iters=ITERS, log_interval=1, eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.5", "--adam-eps", "1e-5",
    "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--group-query-attention", "--num-query-groups", "2",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",  # 6 flags: MoE
    "--qk-clip", "--qk-clip-threshold", str(THRESHOLD), "--qk-clip-alpha", "0.5",
    "--optimizer", "muon", "--muon-tp-mode", "distributed"]  # MuonClip (Kimi K2); 4 flags
ZERO = ["--ddp-bucket-size", "5000", "--data-parallel-sharding-strategy"]
LAYOUTS = {  # id: (processes, flags): TP2, PP2, CP2, EP2, recompute, DP2 under ZeRO-1 and -3, in two runs
    "tp2-dp2-ep2-zero1": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--expert-model-parallel-size", "2"] + ZERO + ["optim"]),
    "pp2-cp2-zero3-recompute": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
                                    "--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"] + ZERO + ["optim_grads_params"]),
}  # and ZeRO-2 under Muon below
RTOL = {"lm_loss": 1e-5, "max_attention_logit": 1e-5, "grad_norm": 1e-4}


def max_logits(records) -> list[float]:
    return per_iteration(records, "max_attention_logit")


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    ref = run_reference(corpus + MODEL, tmp_path_factory.mktemp("qk-clip-reference"))
    assert_loss_falls(train_losses(ref.records), 0.3)
    logits = max_logits(ref.records)
    assert len(logits) == ITERS and sum(v > THRESHOLD for v in logits) >= 3, logits  # clipping acts
    assert "max attention logit:" in ref.stdout
    return ref


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qk_clip_layout_matches_single_process(reference, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    assert_layout_matches(reference, nproc, flags, tmp_path, RTOL)


def test_muon_clip_tp2_dp2_zero2_matches_single_process(corpus, tmp_path):
    """MuonClip (Kimi K2): Muon (--muon-tp-mode duplicated) with QK-clip on the dense GQA model,
    TP2 + SP x DP2 under ZeRO-2 against one process, clipping active."""
    moe = MODEL.index("--num-experts")
    dense = MODEL[:moe] + MODEL[moe + 6:-4] + ["--optimizer", "muon", "--muon-tp-mode", "duplicated"]
    one = run_reference(corpus + dense, tmp_path)
    assert "muon (" in one.stdout
    assert sum(v > THRESHOLD for v in max_logits(one.records)) >= 3, max_logits(one.records)
    assert_layout_matches(one, 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + ZERO + ["optim_grads"],
                          tmp_path, RTOL)
