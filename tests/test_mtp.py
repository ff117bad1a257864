"""Multi-token prediction (--mtp-num-layers; issue 30 item 3) and --pipeline-model-parallel-layout
(item 6).

- the MTP loss of a model against the formula written out here in plain PyTorch (DeepSeek-V3
  Sec. 2.2, Megatron-LM's process_mtp_loss): rolled ids, labels and loss mask, [enorm(emb); hnorm(h)]
  through eh_proj, the shared output layer, the masked mean per depth, factor / D;
- Megatron-LM's module names, and the MTP layer MoE exactly when the last decoder layer is;
- the layout string: parsing, each (virtual) stage's global layers, and its refusals (one line
  naming the flag);
- a model with MTP trains the same on TP2+SP, CP2, PP2 with a layout that puts MTP on the last
  stage (uneven stages), and ZeRO-3 as on one process: lm loss, MTP loss (logged in the JSONL)
  and gradient norm per iteration within 1e-5, final weights by global name.
"""
import pytest
import torch
import torch.nn.functional as F

from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.config.pipeline_layout import layout_of, parse_layout, parse_stages
from megalite.model import GPTModel, model_configs
from megalite.model.moe import MoELayer
from tiny import mock, tiny


def _model(**settings):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                padded_vocab_size=64, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                position_embedding_type="rope", normalization="RMSNorm", mtp_num_layers=2,
                mtp_loss_scaling_factor=0.3)
    arch, execution = model_configs(**{**base, **settings})
    model = GPTModel(arch, execution=execution)
    model.initialize(11)
    with torch.no_grad():  # norm weights other than 1: enorm and hnorm must each act on their own half
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _roll(t):
    out = torch.roll(t, -1, dims=-1)
    out[..., -1] = 0
    return out


def reference_mtp(model, ids, labels, mask, depth, factor):
    """factor / D · sum_k sum_i mask_k[i] CE_k[i] / sum_i mask_k[i], written out: module k sees
    h_{k-1} (the decoder's final-normed output for k = 1) and the embedding of ids rolled k times."""
    emb = model.embedding.word_embeddings.weight  # tied: the output layer too
    h = model.decoder(emb[ids].transpose(0, 1), model.rotary(torch.arange(ids.size(1)).expand_as(ids)))
    rotary = model.rotary(torch.arange(ids.size(1)).expand_as(ids))
    total, per_depth = 0.0, []
    for k in range(depth):
        ids, labels, mask = _roll(ids), _roll(labels), _roll(mask)
        m = model.mtp.layers[k]
        e, hn = m.enorm(emb[ids].transpose(0, 1)), m.hnorm(h)
        x = torch.cat([e, hn], dim=-1) @ m.eh_proj.weight.t()  # embedding first, as Megatron-LM
        h = m.final_layernorm(m.transformer_layer(x, rotary))
        ce = F.cross_entropy((h @ emb.t()).transpose(0, 1).reshape(-1, emb.size(0)), labels.reshape(-1),
                             reduction="none").view_as(mask)
        per_depth.append((ce * mask).sum() / mask.sum())
        total = total + per_depth[-1]
    return factor / depth * total, per_depth


def test_mtp_loss_matches_the_formula_written_out():
    torch.manual_seed(0)
    model = _model()
    ids = torch.randint(0, 64, (2, 16))
    labels = torch.randint(0, 64, (2, 16))
    mask = (torch.rand(2, 16) > 0.2).float()
    model.train()
    lm = model(ids, None, None, labels, loss_mask=mask)
    term, stats = model.mtp_loss(mask.sum(), microbatch_mean=True)
    ref, per_depth = reference_mtp(model, ids, labels, mask, 2, 0.3)
    torch.testing.assert_close(term, ref, rtol=1e-5, atol=1e-6)
    for k in range(2):  # the log's (loss sum, tokens) per depth
        torch.testing.assert_close((stats[k, 0] / stats[k, 1]).float(), per_depth[k], rtol=1e-5, atol=1e-6)
    # the gradient of the MTP term reaches the MTP weights, the decoder and the shared embedding
    (lm.sum() * 0 + term).backward()
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.grad.abs().sum() > 0
    # evaluation (and generation) runs no MTP
    model.eval()
    with torch.no_grad():
        model(ids, None, None, labels, loss_mask=mask)
    assert model.mtp_loss(mask.sum(), microbatch_mean=True) is None


def test_mtp_names_are_megatron_lms_and_follow_the_last_layer_kind():
    model = _model(mtp_num_layers=1)
    names = {n for n, _ in model.global_named_parameters() if n.startswith("mtp.")}
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
                 "transformer_layer.self_attention.linear_qkv.weight"):
        assert f"mtp.layers.0.{part}" in names, sorted(names)
    assert model.mtp.layers[0].eh_proj.weight.shape == (32, 64)
    moe = dict(num_experts=4, moe_router_topk=2, add_bias_linear=False)
    last_moe = _model(mtp_num_layers=1, moe_layer_freq="[0,1]", **moe)
    assert isinstance(last_moe.mtp.layers[0].transformer_layer.mlp, MoELayer)
    assert [n for n, _ in last_moe.moe_layers()] == [1, 2]  # MTP's numbered after the decoder's
    last_dense = _model(mtp_num_layers=1, moe_layer_freq="[1,0]", **moe)
    assert not isinstance(last_dense.mtp.layers[0].transformer_layer.mlp, MoELayer)


def test_dsa_mtp_layer_trains_its_indexer_and_logs_as_megatron_lm():
    """DeepSeek-V3.2's MTP layer is MLA + DSA like the decoder's: its indexer's loss trains it with the
    decoder layers' weight (the trainer's loss scale x coeff, whatever --mtp-loss-scaling-factor), and
    the logged indexer loss sums every DSA layer's and divides by the decoder's layers (Megatron-LM's
    MTP numbers its DSAttention 1..D into the tracker's num_layers slots)."""
    from megalite.model import dsa
    dsa_settings = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
                        qk_pos_emb_head_dim=8, v_head_dim=12, init_method_std=0.2, add_bias_linear=False,
                        experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=12,
                        dsa_indexer_topk=5, dsa_indexer_loss_coeff=0.1, mtp_num_layers=1)
    ids, labels = (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in (1, 2))

    def step(loss_scale, mtp_factor):
        torch.manual_seed(0)  # _model's norm weights
        model = _model(**dsa_settings)
        layers = dsa.dsa_layers([model])
        assert sorted(m.in_mtp for m in layers) == [False, False, True]
        model.train()
        dsa.start_iteration([model], loss_scale)
        lm = model(ids, None, None, labels)
        term, _ = model.mtp_loss(torch.tensor(32.0), microbatch_mean=True)
        (lm.mean() + term * mtp_factor).backward()
        wk = model.mtp.layers[0].transformer_layer.self_attention.core_attention.indexer.linear_wk.weight
        return model, layers, wk.grad.clone()

    model, layers, grad = step(1.0, 1.0)
    sums = [float(m.loss_sum) for m in layers]
    assert min(sums) > 1e-4, sums
    logged = dsa.iteration_indexer_loss([model], 1, 1, 1, torch.device("cpu"))
    assert logged == pytest.approx(sum(sums) / 2, rel=1e-12)  # 3 layers' losses over the decoder's 2
    assert grad.abs().sum() > 0
    torch.testing.assert_close(step(1.0, 0.25)[2], grad, rtol=0, atol=0)  # not scaled by the MTP factor
    torch.testing.assert_close(step(2.0, 1.0)[2], 2 * grad, rtol=1e-6, atol=0)  # by the loss scale


# -- --pipeline-model-parallel-layout ------------------------------------------------------------------
def test_layout_parses_megatron_strings_into_stage_layers():
    assert parse_stages("E(tt|)*2tL") == ["Ett", "tt", "tL"]
    assert parse_stages("Et*3|t,m|L") == ["Ettt", "tm", "L"]
    lay = parse_layout("E(tt|)*2tL", 3, 5, None)
    assert [lay.chunk_layers(r) for r in range(3)] == [[(0, 2)], [(2, 2)], [(4, 1)]]
    # 4 stages on PP 2: two virtual stages per rank, stage k on rank k % 2
    lay = parse_layout("Et|t|tt|mL", 2, 4, 1)
    assert lay.vpp == 2
    assert lay.chunk_layers(0) == [(0, 1), (2, 2)] and lay.chunk_layers(1) == [(1, 1), (4, 0)]
    assert layout_of("Ettt|tmL", 2).chunk_layers(1) == [(3, 1)]


@pytest.mark.parametrize("layout,extra,message", [
    ("Et|t|tL", [], "3 stages, not a multiple of --pipeline-model-parallel-size (2)"),
    ("tE|tL", [], "E (the embedding) must appear once, first in the first stage"),
    ("Et|Lt", [], "L (the loss) must appear once, last in the last stage"),
    ("Ett|tL", [], "places 3 transformer layers (t); --num-layers is 2"),
    ("Et|tL", ["--mtp-num-layers", "1"], "places 0 MTP layers (m); --mtp-num-layers is 1"),
    ("Etm|tL", ["--mtp-num-layers", "1"], "the MTP layers (m) sit on the last stage"),
    ("Et|mtL", ["--mtp-num-layers", "1"], "the MTP layers (m) sit on the last stage"),
    ("Ex|tL", [], "unknown symbol(s) x"),
    ("Et|tL", ["--num-layers-per-virtual-pipeline-stage", "1"], "both set the virtual stages"),
    ("Et|tL", ["--pipeline-model-parallel-size", "1"], "virtual stages need --pipeline-model-parallel-size >= 2"),
])
def test_layout_refusals_name_the_flag_in_one_line(layout, extra, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    pp = ["--pipeline-model-parallel-size", "2"] if "--pipeline-model-parallel-size" not in extra else []
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(tiny() + mock() + pp + ["--pipeline-model-parallel-layout", layout] + extra))
    text = str(e.value)
    assert message in text and "--pipeline-model-parallel-layout" in text and "\n" not in text, text


def test_layout_sets_the_virtual_stages(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    c = validate_args(parse_args(tiny(num_layers=3) + mock() + [
        "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|t|mL", "--mtp-num-layers",
        "1"]))
    assert c.parallel.virtual_pipeline_model_parallel_size == 2
    assert c.parallel.pipeline_schedule == "interleaved_1f1b"


def test_mtp_flags_reach_the_model():
    c = validate_args(parse_args(tiny() + mock() + ["--mtp-num-layers", "2"]))
    assert c.model.mtp_num_layers == 2 and c.model.mtp_loss_scaling_factor == 0.1  # Megatron-LM's default
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(tiny() + mock() + ["--mtp-num-layers", "0"]))
    assert "--mtp-num-layers" in str(e.value)


# -- every layout computes the same function ----------------------------------------------------------------
# fp32, dropout 0, clipping active; MTP 1 (weight 0.5 so that it moves the weights visibly), RoPE, 3 layers so
# that the PP 2 layout is uneven (1 + 2 layers, MTP with the loss); the CP chunks are 8 tokens: the rolled ids
# cross them. ZeRO-3 on DP 2 with the tied embedding gathered for the output layer and MTP.
MTP_MODEL = tiny(num_layers=3, seq_length=32, lr=3e-3, train_iters=6, log_interval=1, eval_interval=3,
                 eval_iters=1) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.25", "--adam-eps", "1e-4",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--mtp-num-layers", "1",
    "--mtp-loss-scaling-factor", "0.5"]
MTP_LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "pp2-layout": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|ttmL"]),
    "zero3": (2, ["--data-parallel-sharding-strategy", "optim_grads_params", "--ddp-bucket-size", "5000"]),
}


def mtp_losses(records) -> list[float]:
    return [r["mtp_1_loss"] for r in records if "consumed_samples" in r]


@pytest.fixture(scope="module")
def mtp_reference(corpus, tmp_path_factory):
    from dist_helpers import assert_loss_falls, grad_norms, load_params, run_pretrain, train_losses
    tmp = tmp_path_factory.mktemp("mtp")
    records, proc = run_pretrain(1, corpus + MTP_MODEL + ["--save", str(tmp / "ckpt")], tmp, "reference")
    assert_loss_falls(train_losses(records), 0.3)
    assert_loss_falls(mtp_losses(records), 0.3)  # logged in the JSONL, per iteration
    assert min(grad_norms(records)) > 0.25  # clipping acts on every iteration
    params = load_params(str(tmp / "ckpt"))
    assert "mtp.layers.0.eh_proj.weight" in params
    return records, params, str(tmp / "ckpt")


@pytest.mark.parametrize("layout", list(MTP_LAYOUTS))
def test_mtp_layout_matches_single_process(mtp_reference, corpus, tmp_path, layout):
    from dist_helpers import (assert_losses_close, assert_params_close, eval_losses, grad_norms, load_params,
                              run_pretrain, train_losses)
    ref_records, ref_params, _ = mtp_reference
    nproc, flags = MTP_LAYOUTS[layout]
    records, _ = run_pretrain(nproc, corpus + MTP_MODEL + flags + ["--save", str(tmp_path / "ckpt")], tmp_path)
    assert_losses_close(train_losses(ref_records), train_losses(records), rtol=1e-5)
    assert_losses_close(mtp_losses(ref_records), mtp_losses(records), rtol=1e-5)
    assert_losses_close(grad_norms(ref_records), grad_norms(records), rtol=1e-5)
    assert_losses_close(eval_losses(ref_records), eval_losses(records), rtol=1e-5)
    assert_params_close(ref_params, load_params(str(tmp_path / "ckpt")), atol=1e-5)


# -- the planner (tools/plan.py) counts MTP and uses the layout's stages ----------------------------------
PLAN_SMALL = ["--vocab-size", "1000", "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--micro-batch-size", "2", "--mtp-num-layers", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-layer-freq", "[0,1,1]"]


@pytest.mark.parametrize("options", [[], ["--untie-embeddings-and-output-weights"], MOE],
                         ids=["tied-learned", "untied", "moe-last"])
@pytest.mark.parametrize("pp,layout", [(1, None), (2, "Et|ttmmL"), (2, "Et|t|t|mmL")],
                         ids=["pp1", "pp2-layout", "pp2-vpp-layout"])
def test_planner_params_match_the_built_model(options, pp, layout):
    import os
    import sys

    from dist_helpers import ROOT
    from plan_helpers import built_stage_params
    from megalite.planning.memory import stage_params, total_params
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan
    argv = PLAN_SMALL + options + ["--pipeline-model-parallel-size", str(pp), "--world-size", str(pp),
                                   "--global-batch-size", "4"]
    argv += ["--pipeline-model-parallel-layout", layout] if layout else []
    c, _ = plan.parse(argv)
    built, once = built_stage_params(c)
    assert [stage_params(c, r) for r in range(pp)] == built
    assert total_params(c) == once


# an MoE MTP layer (the last decoder layer is MoE): its router's load-balancing loss counts (and is
# logged) as every MoE layer's; EP 2 with the all-to-all dispatcher against one process
MOE_MTP = MTP_MODEL + ["--train-iters", "3", "--eval-iters", "0", "--num-experts", "4", "--moe-router-topk", "2",
                       "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,0,1]", "--moe-aux-loss-coeff", "1e-2",
                       "--disable-bias-linear"]


def test_moe_mtp_layer_under_expert_parallelism(corpus, tmp_path):
    from dist_helpers import assert_losses_close, grad_norms, run_pretrain, train_losses
    ref, _ = run_pretrain(1, corpus + MOE_MTP, tmp_path, "reference")
    ep, _ = run_pretrain(2, corpus + MOE_MTP + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                                "alltoall"], tmp_path, "ep2")
    moe = [r for r in ref if r.get("event") == "moe"]
    assert [layer["layer"] for layer in moe[0]["layers"]] == [2, 3]  # the decoder's last layer and MTP's
    for key in ("lm_loss", "mtp_1_loss", "load_balancing_loss", "grad_norm"):
        values = [[r[key] for r in rs if "consumed_samples" in r] for rs in (ref, ep)]
        assert_losses_close(values[0], values[1], rtol=1e-5)
    assert train_losses(ref)[-1] < train_losses(ref)[0] and min(grad_norms(ref)) > 0


def test_mtp_checkpoint_loads_on_a_pipeline_layout(mtp_reference, corpus, tmp_path):
    """The one-process checkpoint, loaded on PP 2 with MTP (and the tied output layer) on the last
    stage: its copy of the embedding arrives from the first stage; the final evaluation equals the
    reference's (nothing left to train)."""
    from dist_helpers import assert_losses_close, run_pretrain
    ref_records, _, ckpt = mtp_reference
    records, _ = run_pretrain(2, corpus + MTP_MODEL + MTP_LAYOUTS["pp2-layout"][1] + ["--load", ckpt], tmp_path)
    final = {(r["split"], r["iteration"]): r["lm_loss"] for r in ref_records if "split" in r}
    loaded = [(r["split"], r["iteration"], r["lm_loss"]) for r in records if "split" in r]
    assert loaded and all(it == 6 for _, it, _ in loaded), loaded
    assert_losses_close([final[(split, it)] for split, it, _ in loaded], [loss for _, _, loss in loaded], rtol=1e-5)
