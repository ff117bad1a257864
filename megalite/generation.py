"""Text generation from a checkpoint, on one process or a tensor-parallel group, for trying a model out.

Decoding keeps a key/value cache (Pope et al. 2022, "Efficiently Scaling Transformer Inference",
Sec. 2): the prompt runs through the model once, and each new token then attends to the cached
keys and values of every earlier position instead of recomputing them, so a step costs O(s)
rather than a whole O(s²) forward pass. Under tensor parallelism each rank's attention caches its
own heads (query groups), as it computes them; the logits are gathered over the vocabulary shards
before sampling, so every rank picks the same token. `use_cache=False` recomputes the whole
sequence per token: the reference the cached path is tested against (greedy output identical).
Logits of padded vocabulary rows (ids >= the real vocabulary size) are never sampled: those rows
are zeros, not tokens. Mixture-of-Experts layers decode as dense ones do: in eval mode the router
computes no auxiliary loss, and one process (no expert-parallel group) holds every expert. With
--moe-expert-capacity-factor an expert's capacity counts one forward pass's tokens, so a cached
one-token step can keep a choice that the recomputed sequence drops: the two decodings may differ.
"""
from __future__ import annotations

import contextlib

import torch

from . import comm
from .checkpoint.files import inspect_checkpoint
from .checkpoint.offline import load_full_state_dict
from .checkpoint.native import local_shard
from .config import from_saved
from .errors import CheckpointError
from .errors import InputError
from .model import GPTConfig, GPTModel, pad_vocab_size
from .model.attention import SelfAttention
from .model.gated_delta_net import DeltaNetState, GatedDeltaNet
from .model.mla import MLASelfAttention



def load_model(load_dir: str, iteration: int | None = None, tp_group=None) -> tuple[GPTModel, dict]:
    """(model in eval mode with fp32 weights, metadata) of the latest checkpoint under `load_dir`;
    with `tp_group`, this rank's tensor-parallel shard of it (whatever layout it was saved in)."""
    inspect_checkpoint(load_dir, "--load", iteration)  # one-line errors naming a missing or corrupt file
    meta, state = load_full_state_dict(load_dir, iteration)
    cfg = dict(meta["model_config"])
    divisible_by = cfg.get("make_vocab_size_divisible_by") or from_saved(meta)["model"].get(
        "make_vocab_size_divisible_by") or 128  # the second: checkpoints of config version 1
    tp, tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    # no dropout; the vocabulary padded for this TP size (and the default ExecutionConfig: fp32, no
    # recompute, no sequence parallelism)
    cfg.update(padded_vocab_size=pad_vocab_size(cfg["vocab_size"], int(divisible_by), tp), hidden_dropout=0.0,
               attention_dropout=0.0)
    model = GPTModel(GPTConfig.from_dict(cfg), tp_group)
    names = dict(model.global_named_parameters())
    buffers = {n: b for n, b in model.global_named_buffers() if n in state}  # MoE expert biases
    missing, unexpected = sorted(set(names) - set(state)), sorted(set(state) - set(names) - set(buffers))
    if missing or unexpected:
        raise CheckpointError(f"{meta['dir']} does not fit its own model_config: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, p in names.items():
            p.copy_(local_shard(state[name], p, tp_rank, tp))  # pads the vocabulary rows with zeros
        for name, b in buffers.items():
            b.copy_(state[name].view_as(b))
    model.eval()
    return model, meta


class KVCache:
    """One attention layer's keys and values for the positions seen so far, this rank's query
    groups only: [max_len, b, ng/tp, hn] each, preallocated, filled as positions arrive. For
    multi-latent attention (model/mla.py) the compressed latent [max_len, b, kv_lora_rank] and the
    rotated decoupled key [max_len, b, 1, qk_pos_emb_head_dim] instead, up-projected when attending."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.k = self.v = None
        self.index_k = None  # DeepSeek Sparse Attention's indexer keys [max_len, b, D] (model/dsa.py)

    def update_index_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Append the indexer keys of the positions `update` just added; return them all so far."""
        if self.index_k is None:
            self.index_k = k.new_empty((self.max_len, *k.shape[1:]))
        self.index_k[self.length - k.size(0):self.length] = k
        return self.index_k[:self.length]

    def update(self, k: torch.Tensor, v: torch.Tensor, attention_mask=None):
        """Append the new positions' k, v [s, b, ng, hn]; return all keys and values so far and the
        mask for the new queries (None: plain causal, when the cache was empty)."""
        s, start = k.size(0), self.length
        if start + s > self.max_len:
            raise ValueError(f"key/value cache full: {start} + {s} positions > {self.max_len}")
        if self.k is None:
            self.k = k.new_empty((self.max_len, *k.shape[1:]))
            self.v = v.new_empty((self.max_len, *v.shape[1:]))
        self.k[start:start + s], self.v[start:start + s] = k, v
        self.length = start + s
        if attention_mask is None and start > 0:
            # query i (position start + i) sees keys 0 .. start + i: causal, aligned bottom-right
            attention_mask = torch.ones(s, self.length, dtype=torch.bool, device=k.device).tril(start)[None, None]
        return self.k[:self.length], self.v[:self.length], attention_mask


@contextlib.contextmanager
def kv_cache(model, max_len: int):
    """Give every attention layer of `model` an empty KVCache (a gated DeltaNet layer its
    DeltaNetState: the convolution's last inputs and the recurrent state) for the block."""
    layers = [m for m in model.modules() if isinstance(m, (SelfAttention, MLASelfAttention, GatedDeltaNet))]
    for layer in layers:
        layer.inference_cache = DeltaNetState(max_len) if isinstance(layer, GatedDeltaNet) else KVCache(max_len)
    try:
        yield layers
    finally:
        for layer in layers:
            layer.inference_cache = None


@torch.no_grad()
def next_token_logits(model: GPTModel, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """ids [b, s] at positions start .. start + s - 1 -> logits [b, s, vocab] over the real
    vocabulary (padding rows dropped, vocabulary shards gathered over TP), fp32."""
    s = ids.size(1)
    position_ids = torch.arange(start, start + s, device=ids.device).unsqueeze(0).expand_as(ids)
    logits = model(ids, position_ids)  # [s, b, padded vocab / tp]
    logits = comm.all_gather(logits, getattr(model, "tp_group", None), dim=-1)
    return logits.transpose(0, 1)[..., : model.config.vocab_size].float()


@torch.no_grad()
def generate(model: GPTModel, prompt_ids: list[int], max_new_tokens: int, greedy: bool = False,
             temperature: float = 1.0, top_k: int = 0, seed: int = 1234, eod: int | None = None,
             use_cache: bool = True) -> list[int]:
    """The new token ids after `prompt_ids`: greedy (argmax) or sampled from softmax(logits / T)
    over the top k (0: all). Stops after `eod` (included) or `max_new_tokens`. Every rank of a
    tensor-parallel model calls this with the same arguments and gets the same tokens."""
    if not prompt_ids:
        raise InputError("the prompt is empty: --prompt must give at least one token")
    if max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if not greedy and temperature <= 0:
        raise InputError(f"--temperature must be > 0, got {temperature} (use --greedy for argmax decoding)")
    if top_k < 0:
        raise InputError(f"--top-k must be >= 0 (0: no top-k filter), got {top_k}")
    cfg = model.config
    if cfg.position_embedding_type == "learned_absolute" and len(prompt_ids) + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                         f"model's learned positions (--max-position-embeddings {cfg.max_position_embeddings})")
    gen = torch.Generator().manual_seed(seed)

    def pick(logits):  # [vocab], padding excluded
        if greedy:
            return int(torch.argmax(logits))
        logits = logits / temperature
        if 0 < top_k < logits.numel():
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))

    ids = list(prompt_ids)
    cache = kv_cache(model, len(prompt_ids) + max_new_tokens) if use_cache else contextlib.nullcontext([])
    with cache as cached_layers:
        use_cache = bool(cached_layers)  # a model without attention layers has nothing to cache
        new = ids  # what the model has not seen yet: the prompt, then one token per step
        for _ in range(max_new_tokens):
            if use_cache:
                logits = next_token_logits(model, torch.tensor([new]), len(ids) - len(new))[0, -1]
            else:
                logits = next_token_logits(model, torch.tensor([ids]))[0, -1]
            token = pick(logits)
            ids.append(token)
            new = [token]
            if token == eod:
                break
    return ids[len(prompt_ids):]
