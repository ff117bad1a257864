"""The order of F, B and W passes on each pipeline rank for the zero-bubble schedules.

Zero-bubble pipelining (Qi et al. 2024, arXiv 2401.10241) splits each backward into B (the input
gradient, which the previous stage waits for) and W (the weight gradient, which nothing waits for
until the optimizer step), and places the W passes where 1F1B leaves the pipeline idle. The
orders here come from a list scheduler run on unit costs (F = B = W = 1 per stage, no
communication time): every rank, whenever it is free, starts the first ready pass by priority
B > F > W, within a memory limit per rank; the run is a valid execution of the iteration's
dependency graph, so its per-rank orders cannot deadlock whatever the real costs are (a rank
only ever waits for a pass that some rank's order puts before its own).

- zb_h1 (ZB-H1, Sec. 3.1, one chunk per rank): at most p - r micro-batches between F and B on
  rank r, 1F1B's activation limit, and at most p - r + 1 holding anything (F done, W not: the
  one extra holds only W's inputs). At p = 2 that is ZB-H1's bubble (p - 1)(T_F + T_B - T_W), a
  third of 1F1B's (p - 1)(T_F + T_B + T_W) at equal costs; at larger p this greedy order under
  that memory limit leaves more than the paper's hand-made one (unit costs, p = 4: 5 units
  against ZB-H1's 3 and 1F1B's 9; p = 8: 13, 7 and 21).
- zbv (ZB-V, Sec. 4): two chunks per rank in a V: virtual stage s < p on rank s (chunk 0),
  s >= p on rank 2p - 1 - s (chunk 1), so rank 0 holds the first and the last chunk and the
  loss. At most 2p chunk micro-batches held per rank (each half a stage: 1F1B's p micro-batches
  of a whole stage), chunk 0 at most 2p - 1 so that chunk 1 always has room.

`simulate` also gives the bubble fraction tools/plan.py reports.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    chunk: int  # the rank's model chunk
    microbatch: int


@dataclass(frozen=True)
class Geometry:
    """Where virtual stage s of a pipeline of p ranks sits: (rank, chunk)."""
    p: int
    v_shape: bool

    @property
    def num_stages(self) -> int:
        return 2 * self.p if self.v_shape else self.p

    @property
    def chunks(self) -> int:
        return 2 if self.v_shape else 1

    def stage(self, rank: int, chunk: int) -> int:
        return rank if chunk == 0 else 2 * self.p - 1 - rank

    def place(self, stage: int) -> tuple[int, int]:
        return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)


@dataclass
class _Rank:
    next_f: list
    next_b: list
    pending_w: list
    between_f_and_b: int = 0
    chunk0_between: int = 0
    held: int = 0  # F done, W not
    free_at: float = 0.0


def _limits(g: Geometry, r: int) -> tuple[int, int]:
    """(micro-batches between F and B, micro-batches held until W) on rank r."""
    if g.v_shape:
        return 2 * g.p, 2 * g.p
    return g.p - r, g.p - r + 1


def _ready(g: Geometry, st: _Rank, r: int, m: int, done: dict):
    """The passes rank r could start next, as (earliest start, priority, kind, chunk)."""
    lim_fb, lim_held = _limits(g, r)
    options = []
    for c in range(g.chunks):
        s = g.stage(r, c)
        mb = st.next_b[c]
        if mb < st.next_f[c]:  # its F has run here
            t = done[("F", s, mb)] if s == g.num_stages - 1 else done.get(("B", s + 1, mb))
            if t is not None:
                options.append((max(st.free_at, t), 0, "B", c))
        mb = st.next_f[c]
        room = st.between_f_and_b < lim_fb and st.held < lim_held and (c == 1 or st.chunk0_between < 2 * g.p - 1)
        if mb < m and room:
            t = 0.0 if s == 0 else done.get(("F", s - 1, mb))
            if t is not None:
                options.append((max(st.free_at, t), 1, "F", c))
    if st.pending_w:
        options.append((st.free_at, 2, "W", st.pending_w[0][0]))
    return options


def simulate(p: int, m: int, v_shape: bool, costs=(1.0, 1.0, 1.0)):
    """Per rank: the list of (Action, start, end) of one iteration, run on `costs` (T_F, T_B, T_W
    of one whole stage; a V chunk costs half)."""
    g = Geometry(p, v_shape)
    scale = 0.5 if v_shape else 1.0
    cost = {"F": costs[0] * scale, "B": costs[1] * scale, "W": costs[2] * scale}
    ranks = [_Rank([0] * g.chunks, [0] * g.chunks, []) for _ in range(p)]
    done: dict = {}
    out = [[] for _ in range(p)]
    for _ in range(3 * g.num_stages * m):
        best = None
        for r, st in enumerate(ranks):
            options = _ready(g, st, r, m, done)
            if options:
                start = min(o[0] for o in options)
                # among the passes that can start first: B, then F (deeper chunk first), then W
                pick = min((o for o in options if o[0] <= start), key=lambda o: (o[1], -o[3]))
                if best is None or pick[0] < best[1][0]:
                    best = (r, pick)
        if best is None:
            raise RuntimeError(f"zero-bubble planner stalled (p={p}, m={m}, v_shape={v_shape})")
        r, (start, _, kind, c) = best
        _apply(g, ranks[r], r, kind, c, start, cost, done, out)
    return out


def _apply(g: Geometry, st: _Rank, r: int, kind: str, c: int, start: float, cost: dict, done: dict, out) -> None:
    if kind == "F":
        mb = st.next_f[c]
        st.next_f[c] += 1
        st.between_f_and_b += 1
        st.chunk0_between += c == 0
        st.held += 1
    elif kind == "B":
        mb = st.next_b[c]
        st.next_b[c] += 1
        st.between_f_and_b -= 1
        st.chunk0_between -= c == 0
        st.pending_w.append((c, mb))
    else:
        c, mb = st.pending_w.pop(0)
        st.held -= 1
    end = start + cost[kind]
    done[(kind, g.stage(r, c), mb)] = end
    st.free_at = end
    out[r].append((Action(kind, c, mb), start, end))


def actions(p: int, m: int, v_shape: bool, rank: int) -> list[Action]:
    """The order of passes on pipeline rank `rank`."""
    return [a for a, _, _ in simulate(p, m, v_shape)[rank]]


def bubble_fraction(p: int, m: int, v_shape: bool, costs=(1.0, 1.0, 1.0)) -> float:
    """Idle share of the iteration, averaged over ranks, on `costs`."""
    runs = simulate(p, m, v_shape, costs)
    span = max(end for run in runs for _, _, end in run)
    busy = sum(end - start for run in runs for _, start, end in run)
    return 1.0 - busy / (span * p)


def peak_held(p: int, m: int, v_shape: bool) -> list[int]:
    """Per rank, the most chunk micro-batches whose activations (F done, B not) or W inputs (B
    done, W not) it holds at once in its order: the activation memory tools/plan.py counts."""
    peaks = []
    for run in simulate(p, m, v_shape):
        held = peak = 0
        for a, _, _ in run:
            held += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
