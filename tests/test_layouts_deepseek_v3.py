"""A DeepSeek-V3-shaped model trains the same on every layout as on one process (issue 30,
Done-when), on real text where the loss falls.

The model (DeepSeek-V3, tiny): multi-latent attention with query and KV compression and QK-norm on
the latents, YaRN on the decoupled RoPE channels (--rope-type yarn, factor 4 over an original
context of a quarter of the sequence, --mscale / --mscale-all-dim), MTP 1, 3 layers of which the
first is dense, 4 SwiGLU experts top-2 with sigmoid scores and an expert bias, in 2 groups of
which the best 1 is kept (node-limited routing), the weights scaled by 2.5, a shared expert,
DeepSeek-V3's sequence-wise balance loss, RMSNorm, untied output layer, no biases. The expert
bias moves after every step by the step's token counts, so a layout whose counts differed would
route differently from then on.
Layouts: TP 2 with SP, PP 2 with --pipeline-model-parallel-layout 'Ett|tmL' (the dense and one
MoE layer first, an MoE layer and MTP with the loss last), CP 2 (the rolled MTP ids cross the
chunks), EP 2 (alltoall) under ZeRO-3, and EP2 x TP2 x PP2 (8 ranks, same layout) under ZeRO-3.
Compared per iteration: lm loss, MTP loss and load-balancing loss (rtol 1e-5), the gradient norm
(clipping acts every step; rtol 1e-5), the experts' token counts; and every parameter and expert
bias after the last step, by global name.
"""
import pytest

from dist_helpers import assert_layout_matches, assert_loss_falls, grad_norms, per_iteration, run_reference, train_losses
from tiny import tiny

DEEPSEEK_V3 = tiny(num_layers=3, hidden_size=32, seq_length=32, lr=1e-2, train_iters=7, log_interval=1,
                   eval_iters=0) + [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--clip-grad", "0.25", "--adam-eps", "1e-4",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--ffn-hidden-size", "64",
    # MLA: query and KV compression, QK-norm on the latents, YaRN on the decoupled channels
    "--position-embedding-type", "rope", "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
    "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm",
    "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8",
    "--mscale", "0.9", "--mscale-all-dim", "1.0",
    # MTP 1, weighted so that it moves the weights visibly
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3",
    # MoE: the first layer dense; sigmoid top-2 of 4 with expert bias in 2 groups, group top-1
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0]+[1]*2",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    "1e-2", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-shared-expert-intermediate-size", "16", "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-aux-loss-coeff", "1e-2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2_LAYOUT = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|tmL"]
EP2_A2A = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
ZERO3 = ["--ddp-bucket-size", "5000", "--data-parallel-sharding-strategy", "optim_grads_params"]
LAYOUTS = {  # id: (processes, flags)
    "tp2-sp": (2, TP2_SP),
    "pp2-layout": (2, PP2_LAYOUT),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "ep2-alltoall-zero3": (2, EP2_A2A + ZERO3),
    "ep2-tp2-pp2-zero3": (8, EP2_A2A + TP2_SP + PP2_LAYOUT + ZERO3),
}
RTOL = {"lm_loss": 1e-5, "mtp_1_loss": 1e-5, "load_balancing_loss": 1e-5, "grad_norm": 1e-5}


@pytest.fixture(scope="module")
def deepseek_v3_reference(corpus, tmp_path_factory):
    ref = run_reference(corpus + DEEPSEEK_V3, tmp_path_factory.mktemp("deepseek-v3"), save=True)
    records, params = ref.records, ref.params
    assert_loss_falls(train_losses(records), 0.3)
    assert_loss_falls(per_iteration(records, "mtp_1_loss"), 0.3)
    assert min(grad_norms(records)) > 0.25  # clipping acts on every iteration
    assert min(per_iteration(records, "load_balancing_loss")) > 0
    moe = [r for r in records if r.get("event") == "moe"]
    assert [layer["layer"] for layer in moe[0]["layers"]] == [1, 2, 3]  # layer 0 dense; MTP's layer MoE
    for part in ("linear_q_down_proj.weight", "kv_layernorm.weight", "mtp.layers.0.eh_proj.weight",
                 "shared_experts.linear_fc1.weight", "output_layer.weight"):
        assert any(n.endswith(part) for n in params), part
    biases = [n for n in params if n.endswith("router.expert_bias")]
    # the bias has moved (at this rate it overshoots, +-1e-2 a step: after an odd number of steps it is not 0)
    assert len(biases) == 3 and all(float(params[n].abs().max()) > 0 for n in biases)
    return ref


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepseek_v3_layout_matches_single_process(deepseek_v3_reference, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    assert_layout_matches(deepseek_v3_reference, nproc, flags, tmp_path, RTOL, exact=("expert_tokens_max",),
                          params_atol=1e-5)
