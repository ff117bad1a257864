"""--pipeline-model-parallel-layout: Megatron-LM's stage string, parsed and checked (torch-free).

    "Et|tt|ttm|L"      stages split by '|': E the embedding, t a transformer (decoder) layer,
                       m an MTP module, L the loss (final norm and output layer)
    "E(tt|)*2tL"       X*N repeats one character, (...)*N a group; commas are cosmetic

Stage k of the list (k = v·PP + r) is virtual stage v of pipeline rank r, so PP x VPP stages give
VPP = stages / PP model chunks per rank (Megatron-LM's PipelineParallelLayerLayout). Global layer
numbers run in stage order, so a layout changes which rank holds a layer, never its name: the
checkpoints stay layout-independent.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

FLAG = "--pipeline-model-parallel-layout"
SYMBOLS = {"E": "embedding", "t": "transformer layer", "m": "MTP layer", "L": "loss"}


class LayoutError(ValueError):
    """A layout this run cannot use; the message names the flag."""


def parse_stages(text: str) -> list[str]:
    """The layout string -> one string of symbols per stage, repetitions unrolled."""
    s = text.replace(",", "").replace(" ", "")
    s = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    bad = sorted(set(s) - set(SYMBOLS) - {"|"})
    if bad:
        raise LayoutError(f"{FLAG} {text!r}: unknown symbol(s) {' '.join(bad)}; the symbols are "
                          + ", ".join(f"{k} ({v})" for k, v in SYMBOLS.items()) + ", '|' between stages and X*N "
                          "or (...)*N repetitions")
    return s.split("|")


@dataclass(frozen=True)
class PipelineLayout:
    """Which global transformer layers each (pipeline rank, virtual stage) owns."""
    stages: tuple[str, ...]  # stage k = virtual stage k // pp of rank k % pp
    pp: int

    @property
    def vpp(self) -> int:
        return len(self.stages) // self.pp

    def stage(self, pp_rank: int, chunk: int) -> str:
        return self.stages[chunk * self.pp + pp_rank]

    def chunk_layers(self, pp_rank: int) -> list[tuple[int, int]]:
        """(first global layer, number of layers) of each model chunk of `pp_rank`."""
        out = []
        for c in range(self.vpp):
            k = c * self.pp + pp_rank
            out.append((sum(st.count("t") for st in self.stages[:k]), self.stages[k].count("t")))
        return out

    def max_chunk_layers(self) -> int:
        return max(st.count("t") for st in self.stages)


def layout_of(text: str, pp: int) -> PipelineLayout:
    """A layout already checked by parse_layout (validation), parsed again where it is used."""
    return PipelineLayout(tuple(parse_stages(text)), pp)


def parse_layout(text: str, pp: int, num_layers: int, mtp_num_layers: int | None) -> PipelineLayout:
    """Parse and check `text` for PP `pp`; raises LayoutError naming what is wrong."""
    stages = parse_stages(text)
    if len(stages) % pp:
        raise LayoutError(f"{FLAG} {text!r} has {len(stages)} stages, not a multiple of "
                          f"--pipeline-model-parallel-size ({pp}): stages = PP x virtual stages per rank")
    flat = "".join(stages)
    last = len(stages) - 1
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise LayoutError(f"{FLAG} {text!r}: E (the embedding) must appear once, first in the first stage")
    if flat.count("L") != 1 or not stages[last].endswith("L"):
        raise LayoutError(f"{FLAG} {text!r}: L (the loss) must appear once, last in the last stage")
    if flat.count("t") != num_layers:
        raise LayoutError(f"{FLAG} {text!r} places {flat.count('t')} transformer layers (t); --num-layers is "
                          f"{num_layers}")
    mtp = flat.count("m")
    if mtp != (mtp_num_layers or 0):
        raise LayoutError(f"{FLAG} {text!r} places {mtp} MTP layers (m); --mtp-num-layers is {mtp_num_layers or 0}")
    if mtp and (stages[last].count("m") != mtp or "t" in stages[last][stages[last].index("m"):]):
        raise LayoutError(f"{FLAG} {text!r}: the MTP layers (m) sit on the last stage, after its transformer "
                          f"layers and before L (they share the output layer with the loss)")
    return PipelineLayout(tuple(stages), pp)


def default_layout(num_layers: int, pp: int, vpp: int) -> PipelineLayout:
    """The even split (L / (PP x VPP) layers per chunk) as a layout."""
    per = num_layers // (pp * vpp)
    stages = ["t" * per for _ in range(pp * vpp)]
    return PipelineLayout(tuple(stages), pp)
