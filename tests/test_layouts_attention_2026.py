"""A Qwen3-Next-shaped MoE model (gated DeltaNet layers between gated softmax attention) and a
DeepSeek-V3.2-shaped model (DeepSeek Sparse Attention on MLA, its indexer trained by its own loss)
train the same on each layout as on one process (issue 44, Done-when), on real text where the loss
falls.

Qwen3-Next (tiny): --linear-attention-freq 2 over 4 layers (DeltaNet, softmax, DeltaNet, softmax),
4 key heads of 8 channels with 2 value heads each, conv width 4, --attention-output-gate with
--qk-layernorm, zero-centred RMSNorms, partial RoPE, 4 experts top-2 with a gated shared expert.
Layouts: TP 2 with SP (the DeltaNet's key heads split), PP 2 x CP 2 (uneven kinds per stage: the
layout string 'Ettt|tL'; 4 ranks), EP 2 (alltoall) under ZeRO-3, ZeRO-1 with full recompute, CP 2
under ZeRO-3 (the DeltaNet layers head-parallel; the two softmax layers a2a and p2p; parameters
sharded over the CP replicas) and TP 2 + SP x CP 2 (4 ranks, one key head each; the softmax layers
allgather and a2a+p2p).
DeepSeek-V3.2 (tiny, init std 0.2): MLA with query compression, DSA with 2 indexer heads of 12 channels, top-6 of
the 32 keys (so the sparse choice matters), --dsa-indexer-loss-coeff 0.1, DeepSeek-V3's MoE in the second
layer (sigmoid top-2 of 4, expert bias, shared expert); layouts PP 2, ZeRO-2 with selective recompute,
EP 2 (alltoall) under ZeRO-3, CP 2 and TP 2 + SP x CP 2 (the keys and index keys gathered; top-6 of 32
ties often at the ReLU's 0). The same with DeepSeek-V3.2's multi-token prediction (--mtp-num-layers 1:
an MLA + DSA layer, MoE, whose indexer's loss counts in the logged one as Megatron-LM counts it) on
TP 2 with SP (the indexer duplicated, its target summed over TP) and PP 2 with full recompute (MTP on
the last stage).
Qwen3-Next with one MTP module (--mtp-num-layers 1: its layer gated softmax attention with the MoE MLP)
on TP 2 with SP, its MTP loss compared too; Qwen3-Next on packed documents (--reset-attention-mask,
--reset-position-ids: the DeltaNet's convolution and state start again at each document) on CP 2.
Compared per iteration: lm loss, the DSA indexer loss, the MTP loss and the gradient norm (rtol 1e-5);
every parameter after the last step, by global name (atol 1e-5). Cost: four references (each built when a
layout first needs it), 14 layouts; alone on the shared 2 cores ~52 s, of which the four CP layouts ~20 s,
Qwen3-Next's MTP reference and layout ~9 s and DeepSeek-V3.2's MTP reference and two layouts ~7 s.
"""
import pytest

from dist_helpers import assert_layout_matches, assert_loss_falls, per_iteration, run_reference, train_losses
from tiny import tiny

COMMON = ["--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--adam-eps", "1e-4",
          "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
          "--position-embedding-type", "rope", "--clip-grad", "1.0"]
QWEN3_NEXT = tiny(num_layers=4, hidden_size=32, seq_length=32, lr=1e-2, train_iters=6, log_interval=1,
                  eval_iters=0) + COMMON + [
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8", "--rotary-percent", "0.5",
    "--apply-layernorm-1p", "--qk-layernorm", "--attention-output-gate", "--ffn-hidden-size", "48",
    "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
    "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
    "--linear-num-key-heads", "4", "--linear-num-value-heads", "8",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
    "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate", "--moe-aux-loss-coeff", "1e-2"]
DSA = tiny(num_layers=2, hidden_size=32, seq_length=32, lr=1e-2, train_iters=6, log_interval=1, eval_iters=0) + \
    COMMON + ["--init-method-std", "0.2", "--ffn-hidden-size", "48", "--multi-latent-attention", "--q-lora-rank", "24",
              "--kv-lora-rank", "16",
              "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
              "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "2", "--dsa-indexer-head-dim", "12",
              "--dsa-indexer-topk", "6", "--dsa-indexer-loss-coeff", "0.1",
              # DeepSeek-V3's MoE: the first layer dense, sigmoid top-2 of 4 with an expert bias, a shared expert
              "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-layer-freq",
              "[0,1]", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
              "--moe-router-bias-update-rate", "1e-2", "--moe-shared-expert-intermediate-size", "16",
              "--moe-aux-loss-coeff", "1e-2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
LAYOUTS = {  # id: (model, processes, flags)
    "qwen3-next-tp2-sp": ("qwen3_next", 2, TP2_SP),
    # PP with uneven layer kinds, and CP's all-to-all on both stages
    "qwen3-next-pp2-layout-cp2": ("qwen3_next", 4, CP2 + ["--pipeline-model-parallel-size", "2",
                                                          "--pipeline-model-parallel-layout", "Ettt|tL"]),
    "qwen3-next-ep2-zero3": ("qwen3_next", 2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                               "alltoall", "--ddp-bucket-size", "5000",
                                               "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "qwen3-next-zero1-full-recompute": ("qwen3_next", 2, ["--use-distributed-optimizer", "--recompute-granularity",
                                                          "full", "--recompute-method", "uniform",
                                                          "--recompute-num-layers", "1"]),
    # CP: the DeltaNet layers head-parallel (all-to-all), the gated softmax layers (1 and 3) by two
    # --cp-comm-types each run, under ZeRO-3 over the CP replicas; TP2 x CP2 splits the 4 key heads
    # over both (one per rank)
    "qwen3-next-cp2-a2a-p2p-zero3": ("qwen3_next", 2, CP2 + ["--cp-comm-type", "allgather", "a2a", "allgather", "p2p",
                                                             "--data-parallel-sharding-strategy", "optim_grads_params",
                                                             "--ddp-bucket-size", "5000"]),
    "qwen3-next-tp2-sp-cp2-allgather-a2a+p2p": ("qwen3_next", 4, TP2_SP + CP2 + [
        "--cp-comm-type", "a2a", "allgather", "a2a", "a2a+p2p", "--hierarchical-context-parallel-sizes", "1", "2"]),
    # multi-token prediction on the hybrid: its module's layer is gated softmax attention with the MoE MLP
    "qwen3-next-mtp-tp2-sp": ("qwen3_next_mtp", 2, TP2_SP),
    # packed documents: the DeltaNet layers head-parallel over the whole sequence's document ids,
    # the softmax layers' CP on documents crossing the ranks' chunks
    "qwen3-next-documents-cp2": ("qwen3_next_documents", 2, CP2),
    "dsa-pp2": ("dsa", 2, ["--pipeline-model-parallel-size", "2"]),
    "dsa-zero2-selective": ("dsa", 2, ["--data-parallel-sharding-strategy", "optim_grads",
                                       "--recompute-granularity", "selective"]),
    "dsa-ep2-zero3": ("dsa", 2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                                 "--ddp-bucket-size", "5000", "--data-parallel-sharding-strategy",
                                 "optim_grads_params"]),
    "dsa-cp2": ("dsa", 2, CP2),
    "dsa-tp2-sp-cp2": ("dsa", 4, TP2_SP + CP2),
    # DeepSeek-V3.2's MTP (--mtp-num-layers 1): its module's layer MLA + DSA (MoE, as the last layer), its
    # indexer trained and its loss in the logged one. TP 2 + SP with MTP stands for the DSA model's TP 2 + SP
    # (the decoder's layers run the same); PP 2 puts the MTP module on the last stage, under full recompute
    # (the region recomputed with DSA's own per-chunk recompute inside; the indexer loss logged once)
    "dsa-mtp-tp2-sp": ("dsa_mtp", 2, TP2_SP),
    "dsa-mtp-pp2-full-recompute": ("dsa_mtp", 2, ["--pipeline-model-parallel-size", "2", "--recompute-granularity",
                                                  "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
}
RTOL = {"qwen3_next": {"lm_loss": 1e-5, "grad_norm": 1e-5},
        "qwen3_next_mtp": {"lm_loss": 1e-5, "mtp_1_loss": 1e-5, "grad_norm": 1e-5},
        "qwen3_next_documents": {"lm_loss": 1e-5, "grad_norm": 1e-5},
        "dsa": {"lm_loss": 1e-5, "dsa_indexer_loss": 1e-5, "grad_norm": 1e-5},
        "dsa_mtp": {"lm_loss": 1e-5, "mtp_1_loss": 1e-5, "dsa_indexer_loss": 1e-5, "grad_norm": 1e-5}}
FLAGS = {"qwen3_next": QWEN3_NEXT, "qwen3_next_mtp": QWEN3_NEXT + ["--mtp-num-layers", "1"],
         "qwen3_next_documents": QWEN3_NEXT + ["--reset-attention-mask", "--reset-position-ids"], "dsa": DSA,
         "dsa_mtp": DSA + ["--mtp-num-layers", "1"]}


def _reference(name, corpus, tmp_path_factory):
    ref = run_reference(corpus + FLAGS[name], tmp_path_factory.mktemp(name), save=True)
    assert_loss_falls(train_losses(ref.records), 0.3)
    if name in ("qwen3_next", "qwen3_next_documents"):
        assert any(n.endswith("self_attention.A_log") for n in ref.params)
        return ref
    if name == "qwen3_next_mtp":  # the MTP module's layer: gated softmax attention with the MoE MLP
        assert any(n.startswith("mtp.layers.0.transformer_layer.self_attention.linear_qkv") for n in ref.params)
        assert_loss_falls(per_iteration(ref.records, "mtp_1_loss"), 0.3)
        return ref
    assert any(n.endswith("indexer.linear_wk.weight") for n in ref.params)
    indexer = per_iteration(ref.records, "dsa_indexer_loss")
    print(f"{name} indexer loss per iteration:", indexer)
    # init std 0.2: peaked attention, so that the KL is far above fp32 rounding of its terms
    assert len(indexer) == 6 and min(indexer) > 1e-3
    if name == "dsa_mtp":  # the MTP module's layer has its indexer, trained
        assert "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer.linear_wk.weight" in ref.params
        assert min(per_iteration(ref.records, "mtp_1_loss")) > 0
    return ref


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    """Each model's one-process run, made when a layout first needs it (so that -k runs one)."""
    refs = {}

    def get(name):
        if name not in refs:
            refs[name] = _reference(name, corpus, tmp_path_factory)
        return refs[name]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(references, tmp_path, layout):
    model, nproc, flags = LAYOUTS[layout]
    assert_layout_matches(references(model), nproc, flags, tmp_path, RTOL[model], params_atol=1e-5)


def test_context_parallel_rules():
    """CP's one refusal for the DeltaNet layers (key heads per TP rank that do not split over CP) and
    the notice that their all-to-all ignores --cp-comm-type; DSA under CP runs MLA's allgather only."""
    from megalite.arguments import ArgumentError, parse_args, validate_args
    cp2 = CP2 + ["--mock-data", "--vocab-size", "100"]
    c = validate_args(parse_args(QWEN3_NEXT + cp2), 2)
    assert any("the gated DeltaNet layers always exchange heads by all-to-all" in n for n in c.notices)
    with pytest.raises(ArgumentError, match=r"--linear-num-key-heads \(4\) / --tensor-model-parallel-size \(2\) = 2 "
                                            r"key heads per rank cannot split over --context-parallel-size 4"):
        validate_args(parse_args(QWEN3_NEXT + TP2_SP + ["--context-parallel-size", "4"] + cp2[2:]), 8)
    assert validate_args(parse_args(DSA + cp2), 2).parallel.context_parallel_size == 2  # accepted
    with pytest.raises(ArgumentError, match="multi-latent attention .* runs allgather only"):
        validate_args(parse_args(DSA + cp2 + ["--cp-comm-type", "p2p"]), 2)
    # packed documents: the DeltaNet layers stop at them, DSA's indexer and sparse attention do not
    data = ["--data-path", "corpus_text_document", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert validate_args(parse_args(FLAGS["qwen3_next_documents"] + CP2 + data), 2,
                         check_files=False).data.reset_attention_mask
    with pytest.raises(ArgumentError, match="--reset-attention-mask with --experimental-attention-variant dsa"):
        validate_args(parse_args(DSA + data + ["--reset-attention-mask"]), 1, check_files=False)
