"""megatron-core itself as the reference for Megatron-LM's checkpoint formats (issue 31).

What this gives a test (all on CPU, gloo, fp32; megatron-core runs in its own subprocess):

    import megatron_core_ref as ref
    ref.require()                                   # pytest.skip naming megatron_core when absent
    spec = ref.Spec(swiglu=True, normalization="RMSNorm", position_embedding_type="rope")
    spec.megalite_flags()                           # the same model as pretrain_gpt.py flags
    out = ref.run(spec, [ref.save_torch_dist(tmp / "ckpt", iteration=3),
                         ref.logits(tokens)], tp=2)  # one process per rank, actions in order
    out[1]                                          # [b, s, V] logits of megatron-core's GPTModel

Actions (run in order on one model, results returned in order; rank 0's results):
  save_torch_dist(dir, iteration, optimizer=False, extra_args=None) -> None: dir/iter_{N:07d}/
      (.metadata, __R_N.distcp, common.pt, metadata.json) and dir/latest_checkpointed_iteration.txt,
      with args, iteration, checkpoint_version, opt_param_scheduler, num_floating_point_operations_so_far
      in common.pt and rng_state as a ShardedObject, as megatron/training/checkpointing.py saves them;
      with optimizer=True Adam's moments too, under `optimizer.state.exp_avg.<param key>` (the
      layout-independent form of a non-distributed optimizer) and param_groups in common.pt
  save_legacy(dir, iteration) -> None: dir/iter_{N:07d}/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt
      (`--ckpt-format torch`: each rank's local state_dict_for_save_checkpoint())
  logits(tokens) -> [b, s, V] fp32 (tokens: [b, s] int64)
  load_torch_dist(dir) -> iteration: the checkpoint's model weights into this model (strict)
  adam_step(tokens, labels) -> {global key: tensor}: one optimizer step (the Spec's lr, betas, eps,
      weight decay, clip) on the mean token loss, as Megatron-LM's Adam; the weights after it
  state() -> {global key: tensor}: the full (unsharded) weights under megatron-core's global keys

The model's initial weights are a function of (seed, global key, layer/expert index) alone: every sharded tensor is
filled from one seeded global tensor, so TP1, TP2 and EP2 runs build the same model (norm weights
near 1, everything else N(0, 0.02), the router's expert bias included).

Process-local patches (issue 31): torch.cuda.current_device returns the CPU device; the CUDA RNG
tracker is backed by the CPU generator; torch.cuda.synchronize is a no-op; moe_utils.te_general_gemm
is None (a NameError without Transformer Engine).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import subprocess
import sys
import tempfile
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def available() -> bool:
    """megatron-core importable (found without importing it: its import takes seconds)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no `megatron` package at all
        return False


MISSING = "megatron_core is not installed (pip install -e '.[megatron]')"


def require():
    """Skip the calling test (one line) when megatron-core is not installed; or, for a whole
    module: pytestmark = pytest.mark.skipif(not ref.available(), reason=ref.MISSING)."""
    if not available():
        import pytest
        pytest.skip(MISSING)


# -- the model ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Spec:
    """A tiny GPT both megatron-core and megalite build (Megatron-LM's flag names and defaults)."""
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # GQA when set (--group-query-attention)
    ffn_hidden_size: int | None = None  # default 4h (8h/3 is not forced with swiglu here: set it)
    vocab_size: int = 512  # the padded vocabulary (a multiple of 128 x TP, so megalite pads nothing)
    seq_length: int = 32
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: int = 10000
    swiglu: bool = False
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    # MoE
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_score_function: str = "softmax"
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # optimizer (adam_step)
    lr: float = 1e-3
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def megalite_flags(self) -> list[str]:
        """pretrain_gpt.py flags for the same model (no data, batch or parallel flags)."""
        f = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
             "--num-attention-heads", self.num_attention_heads, "--ffn-hidden-size", self.ffn,
             "--seq-length", self.seq_length, "--max-position-embeddings", self.seq_length,
             "--position-embedding-type", self.position_embedding_type,
             "--normalization", self.normalization, "--norm-epsilon", self.norm_epsilon,
             "--init-method-std", 0.02, "--attention-dropout", 0.0, "--hidden-dropout", 0.0]
        if self.position_embedding_type == "rope":
            f += ["--rotary-base", self.rotary_base]
        if self.num_query_groups:
            f += ["--group-query-attention", "--num-query-groups", self.num_query_groups]
        f += ["--swiglu"] * self.swiglu + ["--untie-embeddings-and-output-weights"] * self.untie_embeddings_and_output_weights
        f += [] if self.add_bias_linear else ["--disable-bias-linear"]
        if self.num_experts:
            f += ["--num-experts", self.num_experts, "--moe-router-topk", self.moe_router_topk,
                  "--moe-router-score-function", self.moe_router_score_function,
                  "--moe-token-dispatcher-type", "allgather", "--moe-aux-loss-coeff", 0.0]
            f += ["--moe-ffn-hidden-size", self.moe_ffn_hidden_size] if self.moe_ffn_hidden_size else []
            f += ["--moe-router-enable-expert-bias"] * self.moe_router_enable_expert_bias
            if self.moe_shared_expert_intermediate_size:
                f += ["--moe-shared-expert-intermediate-size", self.moe_shared_expert_intermediate_size]
                f += ["--moe-shared-expert-gate"] * self.moe_shared_expert_gate
        return [str(x) for x in f]


def save_torch_dist(path, iteration: int = 1, optimizer: bool = False, extra_args: dict | None = None):
    return ("save_torch_dist", dict(path=str(path), iteration=iteration, optimizer=optimizer, extra_args=extra_args or {}))


def save_legacy(path, iteration: int = 1, extra_args: dict | None = None):
    return ("save_legacy", dict(path=str(path), iteration=iteration, extra_args=extra_args or {}))


def logits(tokens):
    return ("logits", dict(tokens=tokens))


def load_torch_dist(path):
    return ("load_torch_dist", dict(path=str(path)))


def adam_step(tokens, labels):
    return ("adam_step", dict(tokens=tokens, labels=labels))


def state():
    return ("state", {})


def run(spec: Spec, actions: list, tp: int = 1, ep: int = 1, timeout: float = 300.0) -> list:
    """Run `actions` on megatron-core's GPTModel for `spec` on max(tp, ep) gloo ranks (one
    subprocess that imports megatron-core and forks the ranks: megatron-core's checkpoint writer
    needs a `__main__` guard);
    rank 0's results, in order. A failure raises with the subprocess's output."""
    return run_many([(spec, actions)], tp, ep, timeout)[0]


def run_many(jobs: list, tp: int = 1, ep: int = 1, timeout: float = 300.0) -> list:
    """run() for several (spec, actions) in one subprocess (megatron-core's import, ~10 s of CPU,
    paid once): one list of results per job."""
    world = max(tp, ep)
    with tempfile.TemporaryDirectory() as tmp:
        job, result = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "result.pkl")
        with open(job, "wb") as f:
            pickle.dump(dict(jobs=jobs, tp=tp, ep=ep, world=world, result=result), f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), job], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(result):
            raise AssertionError(f"megatron-core run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        with open(result, "rb") as f:
            return pickle.load(f)


def corpus_tokens(data_prefix: str, batch: int, seq: int, offset: int = 0):
    """[batch, seq + 1] int64 tokens from a Megatron .bin/.idx corpus (the `corpus` fixture's
    --data-path): real text, so a loss on them falls. Tokens [:, :-1] are inputs, [:, 1:] labels."""
    import numpy as np
    import torch
    from megalite.data.indexed_dataset import IndexedDataset
    ds = IndexedDataset(data_prefix)
    flat, doc = [], 0
    while sum(map(len, flat)) < offset + batch * (seq + 1):
        flat.append(np.asarray(ds[doc], dtype=np.int64))
        doc += 1
    tokens = np.concatenate(flat)[offset:offset + batch * (seq + 1)]
    return torch.from_numpy(tokens.reshape(batch, seq + 1).copy())


# -- inside the subprocess ------------------------------------------------------------------------
def apply_cpu_patches():
    """The four process-local patches that let megatron-core run on CPU (issue 31)."""
    import torch
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None


def transformer_config(spec: Spec, tp: int, ep: int):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    moe = {}
    if spec.num_experts:
        moe = dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_router_topk,
                   moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn, moe_token_dispatcher_type="allgather",
                   moe_router_score_function=spec.moe_router_score_function, moe_aux_loss_coeff=0.0,
                   moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
                   moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
                   moe_shared_expert_gate=spec.moe_shared_expert_gate, moe_grouped_gemm=False,
                   expert_model_parallel_size=ep, moe_router_dtype="fp32")
        if spec.moe_router_enable_expert_bias:
            moe["moe_router_bias_update_rate"] = 0.0  # the bias is a checkpointed buffer; keep it fixed
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, ffn_hidden_size=spec.ffn, normalization=spec.normalization,
        layernorm_epsilon=spec.norm_epsilon, gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu, add_bias_linear=spec.add_bias_linear,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, init_method_std=0.02,
        use_cpu_initialization=True, params_dtype=torch.float32, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, **moe)


def build_model(spec: Spec, tp: int, ep: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    config = transformer_config(spec, tp, ep)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False,
                                          normalization=spec.normalization)
    model = GPTModel(config, layer_spec, vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length,
                     parallel_output=True, position_embedding_type=spec.position_embedding_type,
                     rotary_base=spec.rotary_base,
                     share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights)
    fill_from_seed(model, spec.seed)
    return model


def sharded_tensors(sharded_state_dict):
    """Every ShardedTensor in a megatron-core sharded state dict (factories built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    stack = [sharded_state_dict]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, ShardedTensorFactory):
            stack.append(item.build())
        elif isinstance(item, ShardedTensor):
            yield item


def local_slice(t):
    """The index of a ShardedTensor's local data inside its global tensor."""
    assert t.flattened_range is None, t.key
    return tuple(slice(o, o + n) for o, n in zip(t.global_offset, (1,) * t.prepend_axis_num + tuple(t.local_shape)))


def seeded_slice(key: str, lead: tuple, shape, seed: int):
    """The global tensor `key` at leading (layer, expert) index `lead`: a function of the seed, the
    key and the index alone, so every layout (and a model too large to build twice) gets the same."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{key}{lead}".encode()))
    if key.endswith("layer_norm_weight") or key.endswith("layernorm.weight") or key.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return 0.02 * torch.randn(shape, generator=g)


def fill_from_seed(model, seed: int):
    import torch
    last = (None, None)  # the factories of one parameter (SwiGLU's gate and up halves) come together
    with torch.no_grad():
        for t in sharded_tensors(model.sharded_state_dict()):
            p = t.prepend_axis_num
            lead = tuple(t.global_offset[:p])
            if last[0] != (t.key, lead):
                last = ((t.key, lead), seeded_slice(t.key, lead, tuple(t.global_shape[p:]), seed))
            t.data.copy_(last[1][local_slice(t)[p:]].reshape(t.data.shape))


def global_state(model) -> dict:
    """{global key: full tensor} on rank 0 (all ranks' shards gathered; None elsewhere)."""
    import torch
    import torch.distributed as dist
    mine = [(t.key, tuple(t.global_shape), local_slice(t), t.data.detach().clone())
            for t in sharded_tensors(model.sharded_state_dict())]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    out = {}
    for key, shape, index, data in (x for part in everyone for x in part):
        full = out.setdefault(key, torch.zeros(shape))
        full[index] = data.reshape(full[index].shape)
    # stacked layer tensors are [layers, ...]: strip nothing, the keys are megatron-core's own
    return out


def megatron_args(spec: Spec, tp: int, ep: int, iteration: int, fmt: str, extra: dict):
    """The argparse.Namespace Megatron-LM pickles as `args` (the fields a loader reads)."""
    import argparse
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("vocab_size", "seed")}
    fields.update(ffn_hidden_size=spec.ffn, padded_vocab_size=spec.vocab_size, max_position_embeddings=spec.seq_length,
                  group_query_attention=bool(spec.num_query_groups), tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=1, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
                  virtual_pipeline_model_parallel_size=None, data_parallel_size=max(tp, ep) // tp,
                  iteration=iteration, consumed_train_samples=8 * iteration, consumed_valid_samples=0,
                  ckpt_format=fmt, use_dist_ckpt=fmt != "torch", transformer_impl="local", params_dtype="torch.float32",
                  fp16=False, bf16=False, micro_batch_size=2, global_batch_size=8, train_iters=100,
                  moe_token_dispatcher_type="allgather", layernorm_epsilon=spec.norm_epsilon,
                  tokenizer_type="NullTokenizer", vocab_size=spec.vocab_size - 1, make_vocab_size_divisible_by=128)
    fields.update(extra)
    return argparse.Namespace(**fields)


def scheduler_state(spec: Spec, iteration: int) -> dict:
    """Megatron-LM's OptimizerParamScheduler.state_dict() after `iteration` steps of batch 8."""
    return dict(max_lr=spec.lr, lr_warmup_steps=0, num_steps=8 * iteration, lr_decay_style="constant",
                lr_decay_steps=800, min_lr=0.0, start_wd=spec.weight_decay, end_wd=spec.weight_decay,
                wd_incr_style="constant", wd_incr_steps=800)


def common_state(spec, ctx, iteration: int, fmt: str, extra: dict) -> dict:
    import torch
    return {"args": megatron_args(spec, ctx["tp"], ctx["ep"], iteration, fmt, extra), "checkpoint_version": 3.0,
            "iteration": iteration, "opt_param_scheduler": scheduler_state(spec, iteration),
            "num_floating_point_operations_so_far": 0, "rng_state_cpu": torch.get_rng_state()}


def do_save_torch_dist(spec, ctx, path, iteration, optimizer, extra_args):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    sd = common_state(spec, ctx, iteration, "torch_dist", extra_args)
    del sd["rng_state_cpu"]
    sd["model"] = ctx["model"].sharded_state_dict()
    # megatron/training/checkpointing.py get_rng_state: one object per (pp, tp) rank, replicated over DP
    rng = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]
    sd["rng_state"] = ShardedObject("rng_state", rng, (1, ctx["tp"]), (0, ps.get_tensor_model_parallel_rank()),
                                    replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    if optimizer:
        sd["optimizer"] = ctx["optimizer"].sharded_state_dict(sd["model"])
    ckpt = os.path.join(path, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, ckpt)
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def do_save_legacy(spec, ctx, path, iteration, extra_args):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ctx["ep"] > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    sd = common_state(spec, ctx, iteration, "torch", extra_args)
    sd["rng_state"] = [{"torch_rng_state": sd.pop("rng_state_cpu")}]
    sd["model"] = ctx["model"].state_dict_for_save_checkpoint()
    folder = os.path.join(path, f"iter_{iteration:07d}", name)
    # one writer per file: with EP the TP ranks of each expert rank, otherwise DP rank 0
    if ps.get_data_parallel_rank() == 0 or ctx["ep"] > 1:
        os.makedirs(folder, exist_ok=True)
        torch.save(sd, os.path.join(folder, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def positions_and_mask(tokens):
    """position ids [b, s] and Megatron's causal mask [1, 1, s, s] (True: masked out); megatron-core's
    default mask is built on 'cuda' by name, so it is passed explicitly."""
    import torch
    s = tokens.shape[1]
    return (torch.arange(s).unsqueeze(0).expand_as(tokens),
            torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None])


def do_logits(spec, ctx, tokens):
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    model = ctx["model"]
    model.eval()
    with torch.no_grad():
        out = model(tokens, *positions_and_mask(tokens))  # [b, s, V / tp]
        out = gather_from_tensor_model_parallel_region(out)  # [b, s, V]
    model.train()
    return out.float()


def do_load_torch_dist(spec, ctx, path):
    from megatron.core import dist_checkpointing
    with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    sd = {"model": ctx["model"].sharded_state_dict()}
    loaded = dist_checkpointing.load(sd, os.path.join(path, f"iter_{iteration:07d}"))
    ctx["model"].load_state_dict(loaded["model"], strict=True)
    return iteration


def make_optimizer(spec, model):
    """Megatron-LM's Adam (torch AdamW, decoupled decay) with its param groups: no weight decay on
    biases and 1-D parameters (megatron/core/optimizer/__init__.py), clipping at spec.clip_grad."""
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    adam = torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.adam_beta1, spec.adam_beta2), eps=spec.adam_eps)
    config = OptimizerConfig(optimizer="adam", lr=spec.lr, weight_decay=spec.weight_decay, adam_beta1=spec.adam_beta1,
                             adam_beta2=spec.adam_beta2, adam_eps=spec.adam_eps, clip_grad=spec.clip_grad)

    def init_state(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
    # FP32Optimizer.__init__ puts its loss scale on 'cuda' by name: run the base __init__ instead
    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, adam, config, init_state)
    opt._scale, opt.is_stub_optimizer = torch.tensor([1.0]), False
    return opt


def reduce_grads(model, dp: int):
    """What Megatron-LM's DDP does to the grads of a batch split over `dp` ranks: dense grads
    averaged over data parallel (summed over TP first where sequence parallelism splits the tokens), expert grads (each expert saw every rank's tokens through the
    allgather dispatcher) scaled by 1 / dp."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    for p in model.parameters():
        if p.grad is not None and getattr(p, "sequence_parallel", False):  # norms, router: a partial sum per TP rank
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        if p.grad is None or dp == 1:
            continue
        if getattr(p, "allreduce", True):
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        p.grad /= dp


def clip_grads(model, max_norm: float):
    """Megatron-LM's clip_grad_norm_fp32 (its own builds buffers on 'cuda' by name): the global L2
    norm counts each parameter once (TP-duplicated and data-parallel copies skipped)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    total = torch.zeros(())
    for p in model.parameters():
        if p.grad is None:
            continue
        expert = not getattr(p, "allreduce", True)
        tp_unique = getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0
        dp_unique = expert or ps.get_data_parallel_rank() == 0
        if tp_unique and dp_unique:
            total += p.grad.float().pow(2).sum()
    dist.all_reduce(total)
    norm = total.sqrt()
    coeff = max_norm / (norm + 1e-6)
    if coeff < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coeff)
    return norm


def do_adam_step(spec, ctx, tokens, labels):
    from megatron.core import parallel_state as ps
    model, opt = ctx["model"], ctx["optimizer"]
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = tokens.shape[0] // dp  # each data-parallel rank its share of the batch
    tokens, labels = tokens[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows]
    opt.zero_grad()
    # megatron-core refuses MoE under TP without sequence parallelism in training mode (a performance
    # guard), and its local-spec norms refuse sequence parallelism: with dropout 0, no aux loss and a
    # fixed expert bias, eval mode computes the same loss and gradients, so the step runs in it
    model.train(not (spec.num_experts and ctx["tp"] > 1))
    loss = model(tokens, *positions_and_mask(tokens), labels=labels).float().mean()  # [b, s] per-token losses
    loss.backward()
    reduce_grads(model, dp)
    if spec.clip_grad > 0:
        clip_grads(model, spec.clip_grad)
    assert opt.step_with_ready_grads(), "megatron-core's optimizer skipped the step"
    model.train()
    return global_state(model)


ACTIONS = {"save_torch_dist": do_save_torch_dist, "save_legacy": do_save_legacy, "logits": do_logits,
           "load_torch_dist": do_load_torch_dist, "adam_step": do_adam_step,
           "state": lambda spec, ctx: global_state(ctx["model"])}


def rank_main(rank: int, job: dict, port: int):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(job["world"]),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    dist.init_process_group("gloo", rank=rank, world_size=job["world"])
    ps.initialize_model_parallel(tensor_model_parallel_size=job["tp"], expert_model_parallel_size=job["ep"])
    results = []
    for spec, actions in job["jobs"]:
        model_parallel_cuda_manual_seed(spec.seed)
        model = build_model(spec, job["tp"], job["ep"])
        ctx = dict(model=model, tp=job["tp"], ep=job["ep"], optimizer=make_optimizer(spec, model))
        results.append([ACTIONS[name](spec, ctx, **kwargs) for name, kwargs in actions])
    if rank == 0:
        with open(job["result"], "wb") as f:
            pickle.dump(results, f)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def main(job_path: str):
    import torch.multiprocessing as mp
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    from megalite.rendezvous import free_port
    port = free_port()
    if job["world"] == 1:
        rank_main(0, job, port)
    else:
        # megatron-core imported (and patched) once here, the ranks forked from this process: each
        # spawned rank imported it again (~10 s of CPU a rank); no process group exists before the fork
        apply_cpu_patches()
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        mp.start_processes(rank_main, args=(job, port), nprocs=job["world"], start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1])
