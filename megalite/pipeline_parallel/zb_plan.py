"""The order of F, B and W passes on each pipeline rank for the zero-bubble schedules.

Zero-bubble pipelining (Qi et al. 2024, arXiv 2401.10241) splits each backward into B (the input
gradient, which the previous stage waits for) and W (the weight gradient, which nothing waits for
until the optimizer step), and places the W passes where 1F1B leaves the pipeline idle.

- zb_h1 (ZB-H1, Sec. 3.1, one chunk per rank), written out: rank r runs p - r forwards, then for
  each micro-batch k its B, the next F, and a W once more than r of them wait; the last r W passes
  close the iteration. Rank r holds at most p - r micro-batches between F and B, 1F1B's activation
  limit, and the inputs of at most r + 1 pending W passes (the linears' inputs and output
  gradients). With m >= p its bubble is ZB-H1's (p - 1)(T_F + T_B - T_W), a third of 1F1B's
  (p - 1)(T_F + T_B + T_W) at equal costs (tests/test_zero_bubble.py checks 3m + p - 1 on unit
  costs for p = 2 and 4).
- zbv (ZB-V, Sec. 4): two chunks per rank in a V: virtual stage s < p on rank s (chunk 0),
  s >= p on rank 2p - 1 - s (chunk 1), so rank 0 holds the first and the last chunk and the
  loss. Its order comes from a list scheduler run on unit costs (F = B = W = 1 per stage, a chunk
  half that, no communication time): every rank, whenever it is free, starts the first ready
  pass by priority B > F (the deeper chunk first) > W, holding at most 2p chunk micro-batches
  (each half a stage: 1F1B's p micro-batches of a whole stage), chunk 0 at most 2p - 1 so that
  chunk 1 always has room.

Either way the orders are a valid execution of the iteration's dependency graph, so they cannot
deadlock whatever the real costs are (a rank only ever waits for a pass that some rank's order
puts before its own). `simulate` times them on given costs: tools/plan.py's bubble.
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


def _ready(g: Geometry, st: _Rank, r: int, m: int, done: dict):
    """The passes rank r could start next, as (earliest start, priority, kind, chunk)."""
    lim_fb = lim_held = 2 * g.p
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


def zb_h1_order(p: int, m: int, r: int) -> list[Action]:
    """ZB-H1 on rank r: p - r forwards; per micro-batch B, the next F, a W once more than r wait."""
    warmup = min(p - r, m)
    order = [Action("F", 0, k) for k in range(warmup)]
    next_f, pending = warmup, []
    for k in range(m):
        order.append(Action("B", 0, k))
        pending.append(k)
        if next_f < m:
            order.append(Action("F", 0, next_f))
            next_f += 1
        if len(pending) > r:
            order.append(Action("W", 0, pending.pop(0)))
    return order + [Action("W", 0, k) for k in pending]


def _time_orders(g: Geometry, orders: list[list[Action]], cost: dict):
    """Each pass of fixed per-rank orders at its earliest start: per rank, [(Action, start, end)]."""
    done: dict = {}
    out = [[] for _ in orders]
    pos = [0] * len(orders)
    free = [0.0] * len(orders)
    while any(pos[r] < len(o) for r, o in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                s = g.stage(r, a.chunk)
                if a.kind == "F":
                    ready = 0.0 if s == 0 else done.get(("F", s - 1, a.microbatch))
                elif a.kind == "B":
                    ready = done.get(("F", s, a.microbatch) if s == g.num_stages - 1 else ("B", s + 1, a.microbatch))
                else:
                    ready = done.get(("B", s, a.microbatch))
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = done[(a.kind, s, a.microbatch)] = start + cost[a.kind]
                out[r].append((a, start, free[r]))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"zero-bubble orders deadlock (p={g.p})")
    return out


def simulate(p: int, m: int, v_shape: bool, costs=(1.0, 1.0, 1.0)):
    """Per rank: the list of (Action, start, end) of one iteration, run on `costs` (T_F, T_B, T_W
    of one whole stage; a V chunk costs half)."""
    g = Geometry(p, v_shape)
    if not v_shape:
        return _time_orders(g, [zb_h1_order(p, m, r) for r in range(p)],
                            {"F": costs[0], "B": costs[1], "W": costs[2]})
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
    if not v_shape:
        return zb_h1_order(p, m, rank)
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
