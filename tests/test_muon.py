"""--optimizer muon on one process, in-process (issue 33): megalite's steps equal a plain Muon
written here (Newton-Schulz from Jordan's recipe, Q, K and V orthogonalized each on their own,
spectral scale, decoupled weight decay) with torch's AdamW for the rest, and Lion by its formula;
the momentum survives a checkpoint; a checkpoint of another optimizer, and Muon's flags without
--optimizer muon, are refused with one line."""
import pytest
import torch

from megalite.arguments import ArgumentError, parse_config
from megalite.checkpoint.load import load_checkpoint
from megalite.checkpoint.native.save import CheckpointSaver
from megalite.checkpoint.native.state import TrainState
from megalite.config import DDPConfig, OptimizerConfig, RunConfig
from megalite.distributed import DataParallel
from megalite.errors import CheckpointError
from megalite.model import GPTConfig, GPTModel
from megalite.optimizer import build_lr_scheduler, build_optimizer
from megalite.parallel_state import single_process_state

from tiny import mock, tiny

HEADS, GROUPS, HN, H = 4, 2, 8, 32
CONFIG = GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HN,
                   vocab_size=64, padded_vocab_size=64, seq_length=16, max_position_embeddings=16, swiglu=True,
                   ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0)
TOKENS = torch.arange(17).repeat(4, 1) * 7 % 64  # [b, s + 1]
POSITIONS = torch.arange(16).expand(4, 16)
LR, WD, BETA = 2e-2, 0.1, 0.9


def options(**kw) -> OptimizerConfig:
    base = dict(optimizer="muon", lr=LR, lr_decay_style="constant", lr_decay_iters=100, clip_grad=0.0,
                weight_decay=WD, fused_optimizer=False, muon_momentum=BETA, muon_nesterov=True,
                num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HN)
    return OptimizerConfig(**{**base, **kw})


def build(opt_cfg: OptimizerConfig):
    ps = single_process_state()
    model = GPTModel(CONFIG)
    model.initialize(seed=3)
    named = list(model.global_named_parameters())
    dp = DataParallel([model], [p for _, p in named], ps, DDPConfig(), num_microbatches=1)
    opt = build_optimizer(named, opt_cfg, dp, ps)
    config = RunConfig().to_dict()
    config["optimizer"].update(optimizer=opt_cfg.optimizer, muon_scalar_optimizer=opt_cfg.muon_scalar_optimizer)
    state = TrainState(ps, CONFIG, named, opt, build_lr_scheduler(opt_cfg), None, torch.device("cpu"), config=config)
    return model, state


def grads_of(model, state) -> dict:
    state.optimizer.dp.zero_grad()
    model(TOKENS[:, :-1], POSITIONS, None, TOKENS[:, 1:]).mean().backward()
    state.optimizer.dp.finish_grad_sync()
    return {n: state.optimizer.dp.main_grad(p).view_as(p).clone() for n, p in state.named_params}


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan's quintic Newton-Schulz, as in his Muon repository."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_update(name: str, x: torch.Tensor) -> torch.Tensor:
    """scale x NS(x); the fused QKV as its Q, K and V matrices (rows of each group: 2 query heads,
    a key, a value)."""
    def scaled(m):
        return newton_schulz(m) * max(m.shape) ** 0.5
    if not name.endswith("linear_qkv.weight"):
        return scaled(x)
    hpg = HEADS // GROUPS
    g = x.view(GROUPS, hpg + 2, HN, H)
    out = torch.empty_like(g)
    out[:, :hpg] = scaled(g[:, :hpg].reshape(-1, H)).view(GROUPS, hpg, HN, H)
    out[:, hpg] = scaled(g[:, hpg].reshape(-1, H)).view(GROUPS, HN, H)
    out[:, hpg + 1] = scaled(g[:, hpg + 1].reshape(-1, H)).view(GROUPS, HN, H)
    return out.view_as(x)


def is_matrix(name: str, p) -> bool:
    return p.ndim == 2 and "embedding" not in name and "output_layer" not in name


def test_two_steps_equal_plain_muon_with_adamw_for_the_rest():
    model, state = build(options())
    named = dict(state.named_params)
    weights = {n: p.detach().clone() for n, p in named.items()}
    scalars = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items() if not is_matrix(n, w)}
    adam = torch.optim.AdamW([{"params": [p for n, p in scalars.items() if p.ndim > 1], "weight_decay": WD},
                              {"params": [p for n, p in scalars.items() if p.ndim == 1], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    momentum = {n: torch.zeros_like(w) for n, w in weights.items() if is_matrix(n, w)}
    assert any(n.endswith("linear_qkv.weight") for n in momentum) and len(momentum) == 8
    for _ in range(2):
        grads = grads_of(model, state)
        state.optimizer.step(LR)
        for n, buf in momentum.items():
            buf.lerp_(grads[n], 1 - BETA)
            x = grads[n].lerp(buf, BETA)  # Nesterov
            weights[n] = weights[n] * (1 - LR * WD) - LR * reference_update(n, x)
        for n, p in scalars.items():
            p.grad = grads[n]
        adam.step()
    for n, p in named.items():
        want = weights[n] if n in momentum else scalars[n].detach()
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=2e-6, msg=n)
    assert "muon (5 Newton-Schulz steps" in state.optimizer.describe()


def test_lion_for_the_scalars():
    model, state = build(options(muon_scalar_optimizer="lion", lion_beta1=0.8, lion_beta2=0.95))
    named = dict(state.named_params)
    norm = "decoder.final_layernorm.weight"
    before = named[norm].detach().clone()
    exp_avg = torch.zeros_like(before)
    for _ in range(2):
        g = grads_of(model, state)[norm]
        state.optimizer.step(LR)
        before = before - LR * (0.8 * exp_avg + 0.2 * g).sign()  # 1-D: no weight decay
        exp_avg = 0.95 * exp_avg + 0.05 * g
    torch.testing.assert_close(named[norm].detach(), before, rtol=0, atol=1e-7)


@pytest.fixture
def no_rng(monkeypatch):
    # one process without tensor parallelism has no RNG tracker: save the default generator only
    monkeypatch.setattr("megalite.checkpoint.native.save.rng_state", lambda ts: ({"rng/torch": torch.get_rng_state()}, {}))
    monkeypatch.setattr("megalite.checkpoint.load.set_rng_state", lambda ts, tensors, values: None)


def train(model, state, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        grads_of(model, state)
        state.optimizer.step(LR)
        state.iteration += 1
        losses.append(model(TOKENS[:, :-1], POSITIONS, None, TOKENS[:, 1:]).mean().item())
    return losses


def test_momentum_resumes_and_another_optimizer_is_refused(tmp_path, no_rng):
    model, state = build(options())
    whole = train(model, state, 3)
    model, state = build(options())
    train(model, state, 1)
    CheckpointSaver(str(tmp_path)).save(state, 1)
    model, state = build(options())
    load_checkpoint(state, str(tmp_path))
    assert train(model, state, 2) == pytest.approx(whole[1:], rel=1e-6)
    _, adam = build(options(optimizer="adam"))
    with pytest.raises(CheckpointError, match="--optimizer muon with --muon-scalar-optimizer adam, this run uses "
                                              "--optimizer adam: load it with --no-load-optim"):
        load_checkpoint(adam, str(tmp_path))
    _, lion = build(options(muon_scalar_optimizer="lion"))
    with pytest.raises(CheckpointError, match="--muon-scalar-optimizer lion"):
        load_checkpoint(lion, str(tmp_path))
    load_checkpoint(adam, str(tmp_path), load_optim=False)  # weights only: allowed


@pytest.mark.parametrize("extra,message", [
    (["--muon-tp-mode", "duplicated"], "--muon-tp-mode is a setting of --optimizer muon; this run uses --optimizer adam"),
    (["--optimizer", "muon", "--lion-beta2", "0.9"],
     "--lion-beta2 is a setting of --muon-scalar-optimizer lion; this run's scalar optimizer is adam"),
    (["--optimizer", "muon", "--muon-num-ns-steps", "0"], "--muon-num-ns-steps must be an integer >= 1, got 0"),
])
def test_refused_flags(extra, message):
    with pytest.raises(ArgumentError, match=message):
        parse_config(tiny() + mock() + extra, world_size=1, check_files=False)


@pytest.mark.parametrize("name,partition_dim", [("decoder.layers.0.self_attention.linear_qkv.weight", 0),
                                                ("decoder.layers.0.mlp.linear_fc2.weight", 1)])
def test_blockwise_tp_mode_orthogonalizes_each_rank_shard_alone(name, partition_dim):
    """--muon-tp-mode blockwise (Megatron-LM's default): each TP rank's shard is orthogonalized and
    scaled as a matrix of its own (the fused QKV shard split into its own groups' Q, K and V), with
    no communication: the group is never touched. Column-parallel QKV cut by rows (whole groups per
    rank), row-parallel fc2 by columns; TP 2."""
    from megalite.optimizer.newton_schulz import MatrixSpec, MuonSettings, orthogonalize

    class Untouchable:  # blockwise must not communicate over the TP group
        def __getattr__(self, attr):
            raise AssertionError(f"blockwise used the TP group ({attr})")

    torch.manual_seed(0)
    whole = torch.randn(GROUPS * (HEADS // GROUPS + 2) * HN, H) if partition_dim == 0 else torch.randn(H, 48)
    qkv = (HEADS // GROUPS, HN) if "qkv" in name else None
    spec = MatrixSpec(tp_group=Untouchable(), tp_size=2, partition_dim=partition_dim, qkv=qkv)
    for shard in whole.chunk(2, dim=partition_dim):
        got = orthogonalize(shard, spec, MuonSettings())
        if qkv is None:
            want = newton_schulz(shard) * max(shard.shape) ** 0.5
        else:  # one group per rank: its 2 query heads, key and value
            g = shard.view(1, HEADS // GROUPS + 2, HN, H)
            want = torch.cat([newton_schulz(m) * max(m.shape) ** 0.5 for m in
                              (g[:, :2].reshape(-1, H), g[:, 2].reshape(-1, H), g[:, 3].reshape(-1, H))])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # not the whole matrix's update: blockwise changes the function with the TP size
    assert not torch.allclose(torch.cat([orthogonalize(s, spec, MuonSettings())
                                         for s in whole.chunk(2, dim=partition_dim)], dim=partition_dim),
                              orthogonalize(whole, MatrixSpec(qkv=(qkv[0], qkv[1]) if qkv else None), MuonSettings()),
                              atol=1e-3)
