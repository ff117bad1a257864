"""Flags of Megatron-LM's launch scripts, in one process: batch schedules and the learning-rate
schedule in samples, the model and loss options (each with a check that fails if the flag were
ignored), TikTokenizer, and the refusals with their reasons."""
import base64
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.config import DDPConfig, OptimizerConfig
from megalite.model import ExecutionConfig
from megalite.num_microbatches_calculator import NumMicroBatchesCalculator, parse_step_schedule
from megalite.optimizer import LRScheduler, build_lr_scheduler
from tiny import mock, tiny
from tolerances import assert_close_fp32

BASE = mock(100) + tiny(hidden_size=32, seq_length=16, global_batch_size=None, train_iters=None, eval_iters=0)


def args_of(extra, world=1):
    return validate_args(parse_args(BASE + extra), world)


# -- batch schedules ------------------------------------------------------------------------------
def megatron_rampup(consumed, start, increment, samples, final):
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, written out."""
    if consumed > samples:
        return final
    return start + int(consumed / (samples / ((final - start) // increment))) * increment


def megatron_train_iters(start, increment, samples, final, train_samples):
    """Megatron-LM's update_train_iters with a ramp-up."""
    iterations = consumed = 0
    while consumed <= samples:
        consumed += megatron_rampup(consumed, start, increment, samples, final)
        iterations += 1
    return iterations + (train_samples - consumed) // final


def test_rampup_follows_megatron():
    calc = NumMicroBatchesCalculator(1536, 1, 8, [16, 16, 5859375])
    for consumed in (0, 1, 61034, 61035, 61036, 3000000, 5859375, 5859376, 10**9):
        assert calc.current_global_batch_size(consumed) == megatron_rampup(consumed, 16, 16, 5859375, 1536)
    assert calc.num_microbatches(0) == 2 and calc.num_microbatches(10**9) == 192
    assert calc.iterations_for(10**8) == megatron_train_iters(16, 16, 5859375, 1536, 10**8)
    assert calc.samples_after(calc.iterations_for(10**8)) <= 10**8 < calc.samples_after(calc.iterations_for(10**8) + 1)


def test_step_schedule_syntax():
    assert parse_step_schedule("0:768 250B:1536 500B:3072", 2048) == [(0, 768), (250 * 10**9 // 2048, 1536),
                                                                       (500 * 10**9 // 2048, 3072)]
    calc = NumMicroBatchesCalculator(None, 2, 2, step_schedule=parse_step_schedule("0:4,64:8", 16))
    assert [calc.current_global_batch_size(c) for c in (0, 3, 4, 12)] == [4, 4, 8, 8]
    assert calc.global_batch_size == 8 and calc.iterations_for(20) == 3  # 4 + 4 + 8 (+8 would be 24)
    for bad, why in (("64:8", "first threshold must be 0"), ("0:4 1K", "not TOKENS:BATCH"), ("0:x", "not a number"),
                     ("0:4 16:8 17:4", "same sample")):
        with pytest.raises(ValueError, match=why):
            parse_step_schedule(bad, 16)


def test_rampup_flags_validate_as_megatron():
    a = args_of(["--train-samples", "100", "--rampup-batch-size", "2", "2", "12", "--global-batch-size", "8"])
    assert (a.training.train_iters, a.training.global_batch_size, a.training.num_microbatches) == (14, 8, 4)  # 2+2+4+6 = 14 samples, 86/8 = 10
    a = args_of(["--train-samples", "100", "--step-batch-size-schedule", "0:2 64:4"])
    assert (a.training.global_batch_size, a.training.train_iters) == (4, 26)  # 2 x 2 samples, then 96 / 4


# -- the learning-rate schedule in samples -------------------------------------------------------
def lrs(extra, iterations, batch=4):
    a = args_of(extra + ["--global-batch-size", str(batch)])
    s = build_lr_scheduler(a.optimizer)
    out = []
    for _ in range(iterations):
        out.append(s.get_lr())
        s.step(batch)
    return out


@pytest.mark.parametrize("style,iters,samples", [
    ("cosine", ["--lr-warmup-iters", "3", "--lr-decay-iters", "10"],
     ["--lr-warmup-samples", "12", "--lr-decay-samples", "40"]),
    ("linear", ["--lr-warmup-fraction", "0.25", "--lr-decay-iters", "9"],
     ["--lr-warmup-fraction", "0.25", "--lr-decay-samples", "36"]),
    ("WSD", ["--lr-decay-iters", "12", "--lr-wsd-decay-iters", "4"],
     ["--lr-decay-samples", "48", "--lr-wsd-decay-samples", "16"]),
])
def test_sample_schedule_equals_iteration_schedule(style, iters, samples):
    by_iter = lrs(["--train-iters", "12", "--lr-decay-style", style, "--min-lr", "1e-4"] + iters, 12)
    by_sample = lrs(["--train-samples", "48", "--lr-decay-style", style, "--min-lr", "1e-4"] + samples, 12)
    assert by_iter == by_sample and len(set(by_iter)) > 3


def test_warmup_fraction_ends_inside_an_iteration_as_megatron():
    # Megatron-LM: warmup of 0.25 x 9 x 4 = 9 samples, not int(0.25 x 9) = 2 iterations
    lr = lrs(["--train-iters", "9", "--lr-warmup-fraction", "0.25", "--lr-decay-style", "constant"], 4)
    assert lr == pytest.approx([0.0, 1e-3 * 4 / 9, 1e-3 * 8 / 9, 1e-3])


def test_legacy_iteration_state_is_converted():
    s = LRScheduler(1.0, 0.0, 8, 80, "linear", legacy_steps_per_iteration=4)
    s.load_state_dict({"num_steps": 5})  # written when the schedule counted iterations
    assert s.num_steps == 20 and s.state_dict() == {"num_steps": 20, "unit": "samples"}


# -- model and loss options: each check fails if the flag is ignored -----------------------------
def tiny_config(**kw):
    from megalite.model import GPTConfig
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, padded_vocab_size=64,
                     seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, **kw)


def tiny_model(execution=None, **kw):
    from megalite.model import GPTModel
    return GPTModel(tiny_config(**kw), execution=execution)


def loss_of(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 17), generator=g)
    pos = torch.arange(16).expand(2, 16)
    return model(ids[:, :-1], pos, None, ids[:, 1:]).mean()


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_stores_w_minus_1_and_computes_the_same(normalization):
    from megalite.model import GPTModel
    plain, one_p = (tiny_model(normalization=normalization, apply_layernorm_1p=f) for f in (False, True))
    for m in (plain, one_p):
        m.initialize(seed=3)
    norms = {n: p for n, p in one_p.named_parameters() if "layernorm.weight" in n}
    assert len(norms) == 5 and all(torch.equal(p, torch.zeros_like(p)) for p in norms.values())
    assert torch.allclose(loss_of(plain), loss_of(one_p), rtol=0, atol=1e-6)
    with torch.no_grad():  # a trained weight w is stored as w - 1
        for n, p in one_p.named_parameters():
            if n in norms:
                p.add_(0.5)
                dict(plain.named_parameters())[n].fill_(1.5)
    assert torch.allclose(loss_of(plain), loss_of(one_p), rtol=0, atol=1e-6)


def test_layernorm_1p_exports_the_weight_itself(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from megalite.checkpoint.hf.conversion import to_hf
    from megalite.model import GPTModel
    config = tiny_config(apply_layernorm_1p=True)
    model = GPTModel(config)
    model.initialize(seed=1)
    state = {n: p.detach().clone() for n, p in model.global_named_parameters()}
    to_hf({"model_config": config.to_dict(), "dir": "ck"}, state, str(tmp_path / "hf"))
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for ours, theirs in (("decoder.layers.0.input_layernorm.weight", "transformer.h.0.ln_1.weight"),
                         ("decoder.final_layernorm.weight", "transformer.ln_f.weight")):
        assert torch.equal(hf[theirs], state[ours] + 1) and torch.equal(hf[theirs], torch.ones_like(hf[theirs]))


def test_layernorm_1p_is_checked_against_checkpoints():
    from megalite.checkpoint.native.state import check_model_config
    from megalite.errors import CheckpointError
    with pytest.raises(CheckpointError, match="--apply-layernorm-1p is False in the checkpoint and True"):
        check_model_config(tiny_config().to_dict(), tiny_config(apply_layernorm_1p=True).to_dict(), "ck")
    old = {k: v for k, v in tiny_config().to_dict().items() if k != "apply_layernorm_1p"}
    check_model_config(old, tiny_config().to_dict(), "ck")  # written before the setting existed


def test_cross_entropy_fusion_is_selected_and_fuses_the_sums(monkeypatch):
    from megalite import comm
    from megalite.model import GPTModel
    from megalite.model import gpt as gpt_module
    from megalite.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy
    logits, target = torch.randn(5, 2, 70, requires_grad=True), torch.randint(0, 64, (5, 2))
    a = vocab_parallel_cross_entropy(logits, target, None, 64)
    b = fused_vocab_parallel_cross_entropy(logits, target, None, 64)
    ga, gb = (torch.autograd.grad(x.sum(), logits)[0] for x in (a, b))
    assert torch.allclose(a, b) and torch.allclose(ga, gb)
    calls = []
    monkeypatch.setattr(comm, "group_size", lambda g: 2)  # as TP rank 0 of 2; the sums are counted, not made
    monkeypatch.setattr(comm, "group_rank", lambda g: 0)
    monkeypatch.setattr(comm, "all_reduce", lambda t, g, op=None: calls.append(tuple(t.shape)) or t)
    vocab_parallel_cross_entropy(logits, target, "tp", 128)
    plain, calls[:] = list(calls), []
    fused_vocab_parallel_cross_entropy(logits, target, "tp", 128)
    assert len(plain) == 3 and calls == [(10,), (2, 10)]  # max, then [target logit; sum of exp] of 5 x 2 rows
    monkeypatch.undo()
    used = []
    monkeypatch.setattr(gpt_module, "fused_vocab_parallel_cross_entropy",
                        lambda *a, **k: used.append(1) or fused_vocab_parallel_cross_entropy(*a, **k))
    model = tiny_model(ExecutionConfig(cross_entropy_loss_fusion=True))
    model.initialize(seed=1)
    loss_of(model)
    assert used == [1]


def record_sdpa(monkeypatch):
    """Which SDPA kernels were allowed when scaled_dot_product_attention ran."""
    seen, real = [], F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                     torch.backends.cuda.math_sdp_enabled()))
        return real(*a, **k)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("backend,allowed", [("auto", (True, True, True)), ("flash", (True, False, False)),
                                             ("unfused", (False, False, True)), ("local", None)])
def test_attention_backend_selects_the_kernel(monkeypatch, backend, allowed):
    from megalite.model.attention import CoreAttention
    seen = record_sdpa(monkeypatch)
    execution = ExecutionConfig(attention_backend=backend)
    q = torch.randn(8, 2, 4, 16)
    k, v = torch.randn(8, 2, 2, 16), torch.randn(8, 2, 2, 16)  # grouped-query: 2 groups of 2 heads
    out = CoreAttention(0.0, execution, None)(q, k, v)
    assert seen == ([allowed] if allowed else [])  # local never calls SDPA
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    # the local backend's own matmuls and softmax (tests/tolerances.py): 16-term QK^T, then 8 positions
    assert_close_fp32(out, ref.permute(2, 0, 1, 3).reshape(8, 2, 64), k=16, chain=3)


def test_attention_backend_the_cpu_cannot_run_falls_back_with_a_notice():
    """A GPU kernel choice (Megatron-LM's scripts pass --attention-backend fused): on the CPU, SDPA's
    CPU kernel runs instead, with the kernel's own reason in the notice."""
    a = args_of(["--train-iters", "1", "--attention-backend", "fused"])
    assert a.kernels.attention_backend == "auto" and any(n.startswith("--attention-backend fused: a GPU kernel")
                                                         for n in a.notices)
    a = args_of(["--train-iters", "1", "--attention-backend", "flash", "--attention-dropout", "0.1"])
    assert a.kernels.attention_backend == "auto" and any("dropout" in n for n in a.notices)
    assert args_of(["--train-iters", "1", "--attention-backend", "flash", "--attention-dropout", "0"]) \
        .kernels.attention_backend == "flash"


def test_decoupled_lr_groups_and_schedule():
    from megalite.distributed import DataParallel
    from megalite.model import GPTModel
    from megalite.optimizer import build_optimizer
    from megalite.parallel_state import single_process_state
    a = args_of(["--train-iters", "10", "--lr-warmup-iters", "2", "--decoupled-lr", "5e-3", "--decoupled-min-lr",
                 "5e-4", "--min-lr", "1e-4", "--untie-embeddings-and-output-weights"])
    c = a.optimizer
    model = tiny_model(untie_embeddings_and_output_weights=True)
    model.initialize(seed=1)
    named = list(model.global_named_parameters())
    dp = DataParallel([model], [p for _, p in named], single_process_state(), DDPConfig(), 1)
    opt = build_optimizer(named, c, dp, single_process_state())
    decoupled = {id(p) for g in opt.optimizer.param_groups if g["decoupled"] for p in g["params"]}
    assert decoupled == {id(p) for n, p in named if n in ("embedding.word_embeddings.weight", "output_layer.weight")}
    s = build_lr_scheduler(c)
    s.step(2 * 2)  # warmed up: the peaks
    assert (s.get_lr(), s.get_lr(max_lr=c.decoupled_lr, min_lr=c.decoupled_min_lr)) == (1e-3, 5e-3)
    s.step(100)
    assert (s.get_lr(), s.get_lr(max_lr=c.decoupled_lr, min_lr=c.decoupled_min_lr)) == (1e-4, 5e-4)
    loss_of(model).backward()
    opt.step(1e-3, decoupled_lr=5e-3)
    assert {g["decoupled"]: g["lr"] for g in opt.optimizer.param_groups} == {False: 1e-3, True: 5e-3}


def test_grad_reduce_in_bf16_makes_a_bf16_buffer_that_steps():
    from megalite.distributed import DataParallel
    from megalite.model import GPTModel
    from megalite.optimizer import build_optimizer
    from megalite.parallel_state import single_process_state
    model = tiny_model(ExecutionConfig(params_dtype=torch.bfloat16))
    model.initialize(seed=1)
    named = list(model.global_named_parameters())
    ps = single_process_state()
    dp = DataParallel([model], [p for _, p in named], ps, DDPConfig(grad_reduce_in_bf16=True), 1)
    opt = build_optimizer(named, OptimizerConfig(lr=1e-2, clip_grad=0.0, weight_decay=0.0), dp, ps)
    assert dp.grads.dtype == torch.bfloat16 and dp.grad_bytes == 2 * sum(p.numel() for _, p in named)
    before = [p.detach().clone() for _, p in named]
    loss_of(model).backward()
    assert opt.step(1e-2)["grad_norm"] > 0
    assert all(not torch.equal(b, p) for b, (_, p) in zip(before, named) if p.ndim > 1)


def test_per_token_loss_and_megatron_default():
    """Two micro-batches of 1 and 3 loss tokens: the default weights each micro-batch's mean
    equally, --calculate-per-token-loss weights every token equally."""
    from megalite.pipeline_parallel.schedules import forward_backward_no_pipelining

    class Chunk(torch.nn.Module):  # per-token loss = w * token id, so d loss / d w = sum of ids
        post_process = True

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def set_input_tensor(self, _):
            pass

        def forward(self, ids, pos, mask, labels):
            return self.w * ids.float()
    ids = [torch.tensor([[2.0, 4.0]]), torch.tensor([[6.0, 8.0]])]
    masks = [torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])]
    batches = [{"input_ids": i, "position_ids": None, "attention_mask": None, "labels": None, "loss_mask": m}
               for i, m in zip(ids, masks)]
    grads = {}
    for per_token in (False, True):
        chunk = Chunk()
        scale = 1 / 3 if per_token else 1 / 2  # 3 tokens in the global batch; 2 micro-batches
        forward_backward_no_pipelining([iter(batches)], [chunk], 2, scale, microbatch_mean=not per_token)
        grads[per_token] = chunk.w.grad.item()
    assert grads[False] == pytest.approx((2 / 1 + 14 / 2) / 2) and grads[True] == pytest.approx(16 / 3)


def test_sequence_parallel_at_tp1_is_switched_off_with_a_notice():
    a = args_of(["--train-iters", "1", "--sequence-parallel"])
    assert not a.parallel.sequence_parallel and any("--sequence-parallel switched off" in n for n in a.notices)
    assert args_of(["--train-iters", "1", "--sequence-parallel", "--tensor-model-parallel-size", "2"],
                   2).parallel.sequence_parallel


def test_attention_mask_flag():
    from megalite.data.batch import build_batch
    tokens = torch.tensor([[1, 2, 0, 3, 4, 0, 5]])
    assert build_batch(tokens, 0, reset_attention_mask=True)["attention_mask"] is not None
    assert build_batch(tokens, 0, reset_attention_mask=True, create_attention_mask=False)["attention_mask"] is None
    with pytest.raises(ArgumentError, match="--reset-attention-mask needs the document boundaries"):
        validate_args(parse_args(BASE[3:] + ["--train-iters", "1", "--data-path", "x", "--tokenizer-type",
                                             "NullTokenizer", "--vocab-size", "9", "--reset-attention-mask",
                                             "--no-create-attention-mask-in-dataloader"]), 1, check_files=False)
    # packed documents run megalite's tiled kernel whatever --attention-backend names: said, not ignored
    documents = BASE[3:] + ["--train-iters", "1", "--data-path", "x", "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "9", "--reset-attention-mask"]
    a = validate_args(parse_args(documents + ["--attention-backend", "unfused"]), 1, check_files=False)
    assert any("--attention-backend unfused: --reset-attention-mask attends within documents" in n for n in a.notices)
    with pytest.raises(ArgumentError, match="--use-flash-attn's varlen kernel is not wired in"):
        validate_args(parse_args(documents + ["--use-flash-attn"]), 1, check_files=False)


def test_no_mmap_reads_the_same_tokens_without_a_map(tmp_path):
    from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    prefix = str(tmp_path / "d")
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    rng = np.random.default_rng(0)
    for n in (5, 9, 3):
        b.add_document(rng.integers(0, 1000, n))
    b.finalize(prefix + ".idx")
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap=False)
    assert read._bin_map is None and isinstance(mapped._bin_map, np.memmap)
    for i in range(3):
        assert np.array_equal(mapped[i], read[i]) and np.array_equal(mapped.get(i, 1, 2), read.get(i, 1, 2))
    # the flag reaches the datasets the builder makes
    from megalite.data.builder import build_train_valid_test_datasets
    for mmap in (True, False):
        args = SimpleNamespace(data_path=[prefix], split="100,0,0", data_cache_path=str(tmp_path / "cache"),
                               seq_length=4, seed=1, vocab_size=1000, mmap_bin_files=mmap)
        train = build_train_valid_test_datasets(args, (4, 0, 0))[0]
        assert (train.dataset._bin_map is not None) == mmap and len(train[0]["text"]) == 5


def test_log_throughput_adds_tflops_to_the_line():
    from megalite.runtime.metrics import console_line
    r = {"iteration": 1, "consumed_samples": 8, "elapsed_ms": 1.0, "lr": 1e-3, "lm_loss": 2.0, "tokens_per_sec": 9.0,
         "tflops_per_gpu": 1.5, "mfu": None, "global_batch_size": 8}
    assert "TFLOP/s" not in console_line(r, 2, "", 0, throughput=False)
    assert "throughput per GPU (TFLOP/s/GPU): 1.50" in console_line(r, 2, "", 0, throughput=True)


# -- TikTokenizer ---------------------------------------------------------------------------------
def tiktoken_vocab(path):
    """Megatron-LM's JSON vocabulary: the 256 bytes, then merges (each made of two earlier ranks)."""
    tokens = [bytes([i]) for i in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b" wo"]
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
               for i, t in enumerate(tokens)]
    path.write_text(json.dumps(entries))
    return str(path)


def test_tiktokenizer(tmp_path):
    pytest.importorskip("tiktoken")
    from megalite.data.tokenizers import TikTokenizer, build_tokenizer, check_tokenizer_args
    vocab = tiktoken_vocab(tmp_path / "tok.json")
    args = SimpleNamespace(tokenizer_type="TikTokenizer", tokenizer_model=vocab, tiktoken_pattern="v2",
                           vocab_size=10 + 262, tiktoken_num_special_tokens=10, tiktoken_special_tokens=None)
    check_tokenizer_args(args)
    tok = build_tokenizer(args)
    assert isinstance(tok, TikTokenizer) and (tok.vocab_size, tok.eod) == (272, 2)
    ids = tok.tokenize("hello world")
    assert ids[0] == 10 + 259 and ids[1] == 10 + 261  # "hello", " wo"
    assert tok.detokenize(ids) == "hello world" and tok.tokenize("</s>") != [2]  # special text stays text
    with pytest.raises(Exception, match="262 distinct tokens.*needs 290"):
        build_tokenizer(SimpleNamespace(**{**vars(args), "vocab_size": 300}))
    with pytest.raises(Exception, match="--tiktoken-pattern"):
        check_tokenizer_args(SimpleNamespace(**{**vars(args), "tiktoken_pattern": None}))


# -- refusals, each naming what would be needed ---------------------------------------------------
@pytest.mark.parametrize("extra,pattern", [
    (["--train-iters", "5", "--rampup-batch-size", "2", "2", "8", "--global-batch-size", "8"],
     "--rampup-batch-size needs sample-based training.*Megatron-LM refuses it"),
    (["--train-samples", "40", "--step-batch-size-schedule", "0:2", "--global-batch-size", "4"],
     "--global-batch-size cannot be combined with --step-batch-size-schedule"),
    (["--train-samples", "40", "--rampup-batch-size", "3", "1", "8", "--global-batch-size", "8"],
     "global batch 3 of --rampup-batch-size is not divisible"),
    (["--train-iters", "3", "--train-samples", "9"], "mutually exclusive"),
    (["--train-samples", "40", "--lr-decay-iters", "3"], "with --train-samples give --lr-decay-samples"),
    (["--train-iters", "3", "--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
    (["--train-iters", "3", "--ckpt-format", "zarr"], "--ckpt-format zarr .*is not supported.*torch_dist"),
    (["--train-iters", "3", "--verify-integrity"], "--verify-integrity needs --ckpt-format torch_dist"),
    (["--train-iters", "3", "--context-parallel-size", "2"], r"world size 1 is not divisible .* x --context-parallel-size \(2\)"),
    (["--train-iters", "3", "--decoupled-min-lr", "1e-4"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--train-iters", "3", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--train-iters", "3", "--fp8-format", "e4m3", "--fp8-recipe", "custom"], "--fp8-recipe custom is not supported"),
    (["--train-iters", "3", "--profile-step-start", "1"], "--profile-step-start needs --profile"),
    (["--train-iters", "3", "--profile", "--profile-step-start", "4", "--profile-step-end", "6"],
     "nothing would be traced"),
])
def test_refusals(extra, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        args_of(extra)


def test_accepted_no_ops_and_notices():
    a = args_of(["--train-iters", "1", "--use-mcore-models", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
                 "--transformer-impl", "local", "--timing-log-level", "0", "--rerun-mode", "disabled",
                 "--log-validation-ppl-to-tensorboard", "--empty-unused-memory-level", "2"])
    assert any("--empty-unused-memory-level 2: a no-op on CPU" in n for n in a.notices)
    assert math.isclose(a.optimizer.lr_decay_samples, 2)  # one iteration of 2 samples


@pytest.mark.parametrize("extra,notice", [
    (["--no-mmap-bin-files"], "--no-mmap-bin-files has no effect with --mock-data"),
    (["--split", "98,2,0"], "--split has no effect with --mock-data"),
    (["--tokenizer-type", "NullTokenizer", "--tiktoken-pattern", "v2"],
     "--tiktoken-pattern has no effect with --tokenizer-type NullTokenizer"),
])
def test_accepted_and_ignored_as_megatron_does(extra, notice):
    """Megatron-LM flags it accepts and ignores in a combination: a one-line notice, the run goes on."""
    config = args_of(["--train-iters", "3"] + extra)
    assert [n for n in config.notices if n.startswith(notice)], config.notices


def test_attention_softmax_in_fp32_acts_on_the_local_backend():
    """--attention-softmax-in-fp32 with 16-bit activations: --attention-backend local scales, masks
    and softmaxes the scores in fp32 (a reference computed here), else in bf16; with SDPA's
    backends a notice."""
    from megalite.model.attention import CoreAttention, local_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 24, generator=g).mul(3).to(torch.bfloat16) for _ in range(3))
    scores = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(24))  # 1/sqrt(24) rounds in bf16
    scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    reference = torch.softmax(scores, dim=-1).to(torch.bfloat16) @ v
    assert torch.equal(local_attention(q, k, v, softmax_in_fp32=True), reference)
    assert not torch.equal(local_attention(q, k, v), reference)  # scaled in bf16: other scores
    a = args_of(["--train-iters", "3", "--bf16", "--attention-backend", "local", "--attention-softmax-in-fp32"])
    execution = ExecutionConfig.from_configs(a.optimizer, a.parallel, a.recompute, a.kernels)
    assert CoreAttention(0.0, execution, None).softmax_in_fp32 and not a.notices
    b = args_of(["--train-iters", "3", "--attention-softmax-in-fp32"])
    assert any(n.startswith("--attention-softmax-in-fp32 has no effect with --attention-backend auto")
               for n in b.notices), b.notices


def test_cross_entropy_fusion_impl_te_runs_the_native_loss_with_a_notice():
    run = ["--train-iters", "2"]
    a = args_of(run + ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"])
    assert a.kernels.cross_entropy_fusion_impl == "native" and a.kernels.cross_entropy_loss_fusion
    assert any("--cross-entropy-fusion-impl te: Transformer Engine's cross entropy is not used" in n for n in a.notices)
    b = args_of(run + ["--cross-entropy-fusion-impl", "te"])
    assert any("without --cross-entropy-loss-fusion the flag has no effect" in n for n in b.notices)
    assert not any("cross-entropy" in n for n in args_of(run + ["--cross-entropy-loss-fusion"]).notices)
