"""Name tables: each Hugging Face family's weights written once, as rules read both ways.

A rule ties some megalite tensors (names under a layer's prefix) to some Hugging Face tensors
(names under that layer's prefix there), either unchanged one to one, or through a pair of
inverse functions: `out` (megalite -> Hugging Face) and `back` (Hugging Face -> megalite), each
from a list of tensors to a list. `export_tensors` pops megalite's tensors and returns Hugging
Face's; `import_tensors` is the same table read the other way. A table written once cannot let
the export and the import drift apart (the mirror-image code it replaces could). A missing
tensor is a KeyError naming it, which the callers turn into a one-line error."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    out: Callable[[Tensors], Tensors] | None = None  # megalite -> Hugging Face; None: unchanged
    back: Callable[[Tensors], Tensors] | None = None  # Hugging Face -> megalite; None: unchanged


def same(ours: str, theirs: str) -> Rule:
    """One tensor under two names."""
    return Rule((ours,), (theirs,))


def transposed(ours: str, theirs: str) -> Rule:
    """One weight stored transposed there (GPT-2's Conv1D: [in, out])."""
    return Rule((ours,), (theirs,), lambda t: [t[0].t()], lambda t: [t[0].t()])


def glu(ours: str, gate: str, up: str) -> Rule:
    """A gated MLP's fc1, [gate; up] rows in megalite, as two projections there."""
    return Rule((ours,), (gate, up), lambda t: list(t[0].chunk(2)), lambda t: [torch.cat(t)])


def mapped(ours: str, theirs: str, out: Callable[[torch.Tensor], torch.Tensor],
           back: Callable[[torch.Tensor], torch.Tensor]) -> Rule:
    """One tensor through a pair of inverse functions (a row permutation, say)."""
    return Rule((ours,), (theirs,), lambda t: [out(t[0])], lambda t: [back(t[0])])


def under(ours: str, theirs: str, rules: list[Rule]) -> list[Rule]:
    """The rules with their names under a prefix on each side (a layer's "mlp." and "block_sparse_moe.")."""
    return [Rule(tuple(ours + n for n in r.ours), tuple(theirs + n for n in r.theirs), r.out, r.back) for r in rules]


def expert_rules(num_experts: int, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> list[Rule]:
    """An MoE layer's experts as Mixtral, Qwen-MoE and DeepSeek-V3 name them (under the MLP's prefixes)."""
    rules = []
    for e in range(num_experts):
        ours, theirs = f"experts.local_experts.{e}.", f"experts.{e}."
        rules += [glu(ours + "linear_fc1.weight", f"{theirs}{gate}.weight", f"{theirs}{up}.weight"),
                  same(ours + "linear_fc2.weight", f"{theirs}{down}.weight")]
    return rules


def export_tensors(rules: list[Rule], state: dict, m: str = "", h: str = "") -> dict:
    """Hugging Face's tensors (names under `h`) of the rules, popped from megalite's `state` (under `m`)."""
    return _move(rules, state, to_hf=True, prefixes=(m, h))


def import_tensors(rules: list[Rule], hf: dict, m: str = "", h: str = "") -> dict:
    """megalite's tensors (names under `m`) of the rules, popped from Hugging Face's `hf` (under `h`)."""
    return _move(rules, hf, to_hf=False, prefixes=(h, m))


def _move(rules: list[Rule], source: dict, to_hf: bool, prefixes: tuple[str, str]) -> dict:
    """The rules read one way: pop each rule's tensors on one side, return the other side's."""
    src_prefix, dst_prefix = prefixes
    out = {}
    for r in rules:
        src, dst, fn = (r.ours, r.theirs, r.out) if to_hf else (r.theirs, r.ours, r.back)
        got = [source.pop(src_prefix + n) for n in src]
        out.update(zip([dst_prefix + n for n in dst], fn(got) if fn else got, strict=True))
    return out


def unfuse_experts(hf: dict, prefix: str, num_experts: int, gate: str, up: str, down: str) -> None:
    """transformers 5 holds a layer's experts fused in memory (`experts.gate_up_proj` [E, 2f, h],
    `experts.down_proj` [E, h, f]); the tables name them per expert, as transformers 4 and the
    files do: split them there, in `hf`, before importing."""
    if prefix + "experts.gate_up_proj" not in hf:
        return
    fc1, fc2 = hf.pop(prefix + "experts.gate_up_proj"), hf.pop(prefix + "experts.down_proj")
    for e in range(num_experts):
        hf[f"{prefix}experts.{e}.{gate}.weight"], hf[f"{prefix}experts.{e}.{up}.weight"] = fc1[e].chunk(2)
        hf[f"{prefix}experts.{e}.{down}.weight"] = fc2[e]
