"""QK-clip (--qk-clip; Kimi K2, arXiv 2507.20534, Sec. 2.1 "MuonClip"; Megatron-LM's
megatron/core/optimizer/qk_clip.py and SelfAttention.clip_qk): after each optimizer step, the
query and key projections of the heads whose largest attention logit passed the threshold τ are
scaled down so that, for the same input, it would have been τ.

Per step: each attention layer's `MaxLogitTracker` (model/max_logit.py) holds its local heads'
largest logits over this rank's micro-batches; `prepare` takes the maximum over the DP x CP
replicas (the global batch, and every CP rank's queries: then every replica clips alike), which
is the one-process value on any layout. TP ranks hold whole heads, so each clips its own;
pipeline stages their own layers. For query group g (its heads share one key, GQA),
S_g = max over its heads, η_g = min(1, τ / S_g); its query rows are multiplied by η_g^α and its
key rows by η_g^(1-α) (α = --qk-clip-alpha), so q·k scales by η_g (RoPE rotates both, which
leaves the product's scale alone). With one head per group (MHA) that is Kimi K2's per-head
clip. As Megatron-LM, the weights are rescaled and the biases of --add-qkv-bias are not.

`apply` runs inside the optimizer step, after the update and before the masters reach the
parameters, on the pieces the optimizer steps (`(param, lo, hi, master)`: a whole parameter, or
a ZeRO slice [lo, hi) of its flattened rows, maybe cut by offload), so every sharding strategy
and offload clip the same elements: a row r of the fused QKV weight [ng·(np/ng + 2)·hn, h] is
group r // ((np/ng + 2)·hn), slot (r // hn) mod (np/ng + 2) (queries first, then key, value).
The largest logit of the step (over every layer and rank) is logged as max_attention_logit.
"""
from __future__ import annotations

import torch

from .. import comm
from ..model.attention import SelfAttention
from ..model.max_logit import MaxLogitTracker


class QKClip:
    def __init__(self, model_chunks: list, config, ps, device):
        self.ps, self.device = ps, device
        self.threshold, self.alpha = config.qk_clip_threshold, config.qk_clip_alpha
        self.layers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, SelfAttention)]
        for layer in self.layers:
            layer.max_logits = MaxLogitTracker(layer.num_heads)
        self.max_logit: float | None = None  # the last step's, for the log

    @classmethod
    def build(cls, model_chunks: list, config, ps, device, log) -> "QKClip | None":
        """The clip of an OptimizerConfig (None without --qk-clip), announced with `log`."""
        if not config.qk_clip:
            return None
        clip = cls(model_chunks, config, ps, device)
        log(f"> qk-clip: {len(clip.layers)} attention layers on this rank, threshold {clip.threshold:g}, "
            f"alpha {clip.alpha:g}")
        return clip

    @torch.no_grad()
    def prepare(self) -> dict:
        """Collective (every rank, every step): the step's per-head maxima over DP x CP, the
        largest for the log, and {id(fused QKV weight): per-row scale} of the layers to clip. The
        trackers start again for the next step."""
        maxima = [layer.max_logits.read(self.device) for layer in self.layers]
        flat = torch.cat(maxima) if maxima else torch.empty(0, device=self.device)
        comm.all_reduce(flat, self.ps.dp_cp_group, op=torch.distributed.ReduceOp.MAX)
        top = (flat.max() if flat.numel() else torch.tensor(float("-inf"), device=self.device)).reshape(1)
        comm.all_reduce(top, self.ps.mp_group, op=torch.distributed.ReduceOp.MAX)
        self.max_logit = float(top)
        scales, start = {}, 0
        for layer in self.layers:
            values = flat[start:start + layer.num_heads]
            start += layer.num_heads
            layer.max_logits.reset()
            row = self._row_scale(layer, values)
            if row is not None:
                scales[id(layer.linear_qkv.weight)] = row
        return scales

    def _row_scale(self, layer: SelfAttention, values: torch.Tensor) -> torch.Tensor | None:
        """[rows of the local fused QKV weight] factors, or None when no group passed τ."""
        grouped = values.view(layer.num_groups, layer.heads_per_group).amax(dim=1)  # S_g
        eta = (self.threshold / grouped).clamp(max=1.0)
        eta = torch.where(grouped > self.threshold, eta, torch.ones_like(eta))
        if not bool((eta < 1).any()):
            return None
        hpg = layer.heads_per_group
        row = torch.ones(layer.num_groups, hpg + 2, layer.hn, dtype=torch.float32, device=values.device)
        row[:, :hpg] = eta.pow(self.alpha).view(-1, 1, 1)
        row[:, hpg] = eta.pow(1.0 - self.alpha).view(-1, 1)
        return row.reshape(-1)

    @torch.no_grad()
    def apply(self, pieces, scales: dict) -> None:
        """Scale the stepped tensors of the clipped weights, row by row (see the module docstring)."""
        for p, lo, hi, master in pieces:
            row = scales.get(id(p))
            if row is None:
                continue
            factors = row.repeat_interleave(p.shape[1])[lo:hi].to(master.device)
            master.view(-1).mul_(factors)
