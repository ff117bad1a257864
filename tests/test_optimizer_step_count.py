"""Adam's step count survives save/load whichever way the optimizer keeps it: per parameter
(torch's AdamW) or per parameter group (as apex's FusedAdam does). A lost count restarts Adam's
bias correction, so the resumed run's weights differ from an uninterrupted run's."""
import pytest
import torch

from megalite.checkpoint.load import load_checkpoint
from megalite.checkpoint.native.save import CheckpointSaver
from megalite.checkpoint.native.state import TrainState
from megalite.config import DDPConfig, OptimizerConfig, RunConfig
from megalite.distributed import DataParallel
from megalite.model import GPTConfig, GPTModel
from megalite.optimizer import build_lr_scheduler, build_optimizer
from megalite.optimizer.optimizer import init_optimizer_state
from megalite.parallel_state import single_process_state


class GroupStepAdamW(torch.optim.Optimizer):
    """AdamW whose step count lives in each parameter group, as apex's FusedAdam keeps it."""

    def __init__(self, params, lr, betas, eps):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            (b1, b2), t = g["betas"], g["step"]
            for p in g["params"]:
                st = self.state[p]
                p.mul_(1 - g["lr"] * g["weight_decay"])
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(g["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-g["lr"] / (1 - b1**t))


CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, padded_vocab_size=64,
                   seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
TOKENS = torch.arange(17).repeat(4, 1) * 7 % 64  # [b, s + 1]: a pattern the model learns
POSITIONS = torch.arange(16).expand(4, 16)


def build(per_group: bool) -> tuple[GPTModel, TrainState]:
    ps = single_process_state()
    model = GPTModel(CONFIG)
    model.initialize(seed=5)
    named = list(model.global_named_parameters())
    dp = DataParallel([model], [p for _, p in named], ps, DDPConfig(), num_microbatches=1)
    opt_cfg = OptimizerConfig(lr=1e-2, lr_decay_style="constant", lr_decay_iters=100, clip_grad=0.0,
                              weight_decay=0.0, fused_optimizer=False)
    opt = build_optimizer(named, opt_cfg, dp, ps)
    if per_group:
        opt.optimizer = GroupStepAdamW([{"params": g["params"]} for g in opt.optimizer.param_groups],
                                       lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
        init_optimizer_state(opt.optimizer)
    return model, TrainState(ps, CONFIG, named, opt, build_lr_scheduler(opt_cfg), None, torch.device("cpu"),
                             config=RunConfig().to_dict())


def train(model: GPTModel, state: TrainState, iterations: int) -> list[float]:
    opt, losses = state.optimizer, []
    for _ in range(iterations):
        opt.dp.zero_grad()
        loss = model(TOKENS[:, :-1], POSITIONS, None, TOKENS[:, 1:]).mean()
        loss.backward()
        opt.dp.finish_grad_sync()
        opt.step(state.scheduler.get_lr())
        state.scheduler.step()
        state.iteration += 1
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def _no_rng_tracker(monkeypatch):
    # one process without tensor parallelism has no RNG tracker: save the default generator only
    monkeypatch.setattr("megalite.checkpoint.native.save.rng_state",
                        lambda ts: ({"rng/torch": torch.get_rng_state()}, {}))
    monkeypatch.setattr("megalite.checkpoint.load.set_rng_state", lambda ts, tensors, values: None)


@pytest.mark.parametrize("per_group", [False, True], ids=["per-parameter", "per-group"])
def test_step_count_resumes_exactly(tmp_path, per_group):
    model, straight = build(per_group)
    losses = train(model, straight, 6)
    assert losses[-1] < losses[0] - 0.5  # the model learns the pattern

    model, first = build(per_group)
    train(model, first, 3)
    assert first.optimizer.step_count() == 3
    CheckpointSaver(str(tmp_path)).save(first, first.iteration)

    model, resumed = build(per_group)
    resumed.iteration = load_checkpoint(resumed, str(tmp_path))
    assert resumed.iteration == 3 and resumed.optimizer.step_count() == 3
    train(model, resumed, 3)
    for (name, a), (_, b) in zip(straight.named_params, resumed.named_params):
        assert torch.equal(a, b), name
