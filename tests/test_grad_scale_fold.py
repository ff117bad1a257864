"""The step's gradient factor (1 / loss scale x clip coefficient) folded into torch's fused AdamW as
its `grad_scale` (optimizer/optimizer.py) updates the weights as the explicit passes over the
gradients do (the same fused kernel after them), and the folded step makes no such pass."""
import torch
from torch.profiler import ProfilerActivity, profile

from megalite.config import DDPConfig, OptimizerConfig
from megalite.distributed import DataParallel
from megalite.model import GPTConfig, GPTModel
from megalite.optimizer import build_optimizer
from megalite.parallel_state import single_process_state

CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, padded_vocab_size=64,
                   seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
TOKENS = torch.arange(17).repeat(4, 1) * 7 % 64  # [b, s + 1]: a pattern the model learns
POSITIONS = torch.arange(16).expand(4, 16)
LOSS_SCALE = 1024.0


def _run(fold: bool, fused: bool = True, steps: int = 3):
    ps = single_process_state()
    model = GPTModel(CONFIG)
    model.initialize(seed=5)
    named = list(model.global_named_parameters())
    dp = DataParallel([model], [p for _, p in named], ps, DDPConfig(), num_microbatches=1)
    # clip 0.05: every step clips (the norms here are ~1)
    cfg = OptimizerConfig(lr=1e-2, lr_decay_style="constant", lr_decay_iters=100, clip_grad=0.05,
                          weight_decay=0.1, fused_optimizer=fused)
    opt = build_optimizer(named, cfg, dp, ps)
    assert opt.fold_scale == fused  # torch's fused AdamW takes the factor; the foreach one does not
    opt.fold_scale = fold  # the reference: the same kernel after explicit passes
    norms, losses, ops = [], [], None
    for i in range(steps):
        loss = model(TOKENS[:, :-1], POSITIONS, labels=TOKENS[:, 1:]).mean()
        losses.append(loss.item())
        (loss * LOSS_SCALE).backward()  # a loss-scaled backward: the step unscales by 1 / LOSS_SCALE
        dp.finish_grad_sync()
        if i == steps - 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                update = opt.step(1e-2, grad_scale=1.0 / LOSS_SCALE)
            ops = [e.name for e in prof.events()]
        else:
            update = opt.step(1e-2, grad_scale=1.0 / LOSS_SCALE)
        norms.append(update["grad_norm"])
    return opt, [p.detach().clone() for _, p in named], norms, losses, ops


def test_folded_factor_updates_as_the_explicit_passes():
    # one step from the same gradients: later steps would compare the noise Adam makes of
    # gradients that are rounding noise (a key bias's, zero in exact arithmetic)
    _, fused_params, fused_norms, _, fused_ops = _run(True, steps=1)
    _, plain_params, plain_norms, _, plain_ops = _run(False, steps=1)
    for a, b in zip(fused_norms, plain_norms):
        assert abs(a - b) <= 1e-6 * b, (fused_norms, plain_norms)
    assert all(n > 0.05 for n in plain_norms)  # every step clipped
    # x / (1 / f) and x * f differ in the last bit
    for a, b in zip(fused_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    # the explicit step multiplies the gradients twice (unscale, clip); the folded one not at all
    assert plain_ops.count("aten::_foreach_mul_") >= 2
    assert "aten::_foreach_mul_" not in fused_ops


def test_unfused_adam_keeps_the_explicit_passes():
    opt, *_ = _run(False, fused=False, steps=1)
    assert not opt.fold_scale
