"""Fluid timing of a plan: the simulator's link sharing, without its chunk-level events.

`topology.simulator` follows every flow start, catch-up and release, one event each
(hundreds to thousands per plan: 1.3 s for a 140 GB plan on three-datacenters, which
takes 0.05 s to plan). This model takes the same flow table and max-min filling
(`simulator.max_min_rates`) in two phases:

1. **Fluid phase.** Every flow runs from time 0, with no pipelining lag and no
   latency: rates are max-min fair, and a flow that has caught up with its upstream
   (the relay it reads from) is capped at the upstream's rate. Events are only
   completions, catch-ups and a partial reader reaching its first byte; batches of
   completions within a relative 1e-6 are one event (10-30 events per plan). Each
   flow's completion here (``F``) holds how the links are shared over time: flows
   that finish early leave their share to the others, as several WAN trees that
   share a link do.
2. **Pipelining.** Per transfer, upstream first: it starts one chunk of its bytes
   after its upstream, at the upstream's first rate, plus the upstream path's
   latency (``s``). A transfer that ended its fluid phase held back by its upstream
   (capped, and not itself a bottleneck flow of a saturated link) trails it by that
   chunk: it ends when the upstream's last byte has arrived plus one chunk at the
   rate it gets once released (one more filling). Any other transfer ends at
   ``s + F``, and never before its upstream's last byte has arrived plus one chunk.
   A reader completes one path latency after its last transfer ends.

``pipeline_share`` is how much of the predicted makespan phase 2 adds beyond the
fluid phase: where it is small the model tracks the simulator closely (within a few
per cent; docs/planner.md, "Predicted times"); where pipelining dominates (a version
of a few chunks per stripe, latencies of the order of the transfer)
`topology.estimate.predict` runs the simulator instead.

Cost: O(P) numpy work per event for P (flow, arc) pairs, plus building the
simulator's flow table: 0.5-2x the planning time (docs/planner.md, "Predicted times").
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from weightfabric.topology.plan import Transfer
from weightfabric.topology.simulator import Simulator, max_min_rates

WAITING, ACTIVE, DONE = 0, 1, 2
BATCH = 1e-6  # completions within this relative time of the first are one event


@dataclass
class FluidTimes:
    """What `fluid_times` predicts for each transfer of a plan, in plan order."""

    end: np.ndarray         # when the transfer's last byte has arrived at its reader (s)
    fluid_end: np.ndarray   # its completion in the fluid phase (s)
    events: int             # fluid-phase events

    @property
    def makespan(self) -> float:
        """When the last transfer completes."""
        return float(self.end.max()) if self.end.size else 0.0

    @property
    def pipeline_share(self) -> float:
        """The largest time pipelining and latency add to a transfer, over the makespan."""
        if not self.end.size or self.makespan <= 0:
            return 0.0
        return float(np.max(self.end - self.fluid_end)) / self.makespan

    def completion(self, transfers: list[Transfer]) -> dict[str, float]:
        """Reader -> when its last transfer completes."""
        done: dict[str, float] = {}
        for t, end in zip(transfers, self.end.tolist(), strict=True):
            done[t.reader] = max(done.get(t.reader, 0.0), end)
        return done


def fluid_times(graph: nx.DiGraph, transfers: list[Transfer], chunk: int) -> FluidTimes:
    """Predict each transfer's completion with the two-phase fluid model (module docstring).

    Args:
        graph (networkx.DiGraph): Arcs with ``bandwidth`` (bytes/s) and ``latency`` (s).
        transfers (list of Transfer): A plan's transfers, upstream first.
        chunk (int): The plan's pipelining unit in bytes.

    Returns:
        FluidTimes

    Raises:
        PlanError: A link the transfers use has no positive, finite bandwidth.
    """
    table = Simulator(graph, chunk, 0, {}, None)
    table.add(list(transfers), 0.0)
    phase = _FluidPhase(table)
    phase.run()
    return FluidTimes(end=_pipelined(table, phase), fluid_end=phase.end, events=phase.events)


class _FluidPhase:
    """Phase 1 over a simulator's flow table: ends, first rates, release rates."""

    def __init__(self, table: Simulator) -> None:
        self.t = table
        n = len(table.flows)
        self.pos = np.zeros(n)
        self.status = np.full(n, WAITING, dtype=np.int8)
        self.end = np.zeros(n)
        self.first_rate = np.full(n, np.nan)
        self.release_rate = np.full(n, np.nan)  # NaN: not held back by its upstream
        self.events = 0

    def run(self) -> None:
        t = self.t
        lo, size, up = t.lo, t.hi - t.lo, t.up
        has_up = up >= 0
        upi = np.maximum(up, 0)
        eps = 1e-9 * t.hi + 1e-3
        now = 0.0
        while True:
            st = self.status
            front = lo[upi] + self.pos[upi]
            st[(st == WAITING) & (~has_up | (st[upi] == DONE)
                                  | ((st[upi] == ACTIVE) & (front + eps >= lo)))] = ACTIVE
            active = st == ACTIVE
            if not active.any():
                return
            up_active = has_up & (st[upi] == ACTIVE)
            gap = front - (lo + self.pos)
            capped = active & up_active & (gap <= eps)
            rate, residual = max_min_rates(t.pair_flow, t.pair_arc, t.capacity, up, active,
                                           capped)
            fresh = active & np.isnan(self.first_rate)
            self.first_rate[fresh] = rate[fresh]
            self.events += 1
            finish = np.full(len(rate), np.inf)
            moving = active & (rate > 0)
            finish[moving] = (size - self.pos)[moving] / rate[moving]
            dts = [float(finish.min())]
            m = up_active & ~capped & active & (rate > rate[upi])
            if m.any():
                dts.append(float(np.min(gap[m] / (rate[m] - rate[upi][m]))))
            m = (st == WAITING) & has_up & (st[upi] == ACTIVE) & (rate[upi] > 0)
            if m.any():
                dts.append(float(np.min(np.maximum(lo[m] - front[m], 0) / rate[upi][m])))
            dt = min(dts)
            if not np.isfinite(dt):
                raise RuntimeError("fluid model stalled: no flow can make progress")
            self.pos[active] += rate[active] * dt
            self.pos = np.where(capped, np.minimum(self.pos, np.maximum(
                lo[upi] + self.pos[upi] - lo, 0)), self.pos)
            fin = active & ((finish <= dt * (1 + BATCH)) | (size - self.pos <= eps))
            held = fin & capped
            if held.any():
                held &= ~_bottlenecked(t, rate, residual)
            if held.any():  # their own rate once the upstream's last byte is in
                after = (active & ~fin) | held
                released, _ = max_min_rates(t.pair_flow, t.pair_arc, t.capacity, up, after,
                                            capped & after & after[upi])
                self.release_rate[held] = released[held]
            now += dt
            self.pos[fin] = size[fin]
            st[fin] = DONE
            self.end[fin] = now


def _bottlenecked(t: Simulator, rate: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """Flows with a saturated arc on their path on which no flow runs faster."""
    pf, pa = t.pair_flow, t.pair_arc
    saturated = residual <= 1e-9 * t.capacity
    top = np.zeros(len(residual))
    np.maximum.at(top, pa, rate[pf])
    out = np.zeros(len(rate), dtype=bool)
    out[pf[saturated[pa] & (rate[pf] >= top[pa] * (1 - 1e-9))]] = True
    return out


def _pipelined(t: Simulator, phase: _FluidPhase) -> np.ndarray:
    """Phase 2: start lags and releases down each tree; returns each transfer's end."""
    n = len(t.flows)
    up, lat, lag = t.up, t.lat, t.lag
    level = np.zeros(n, dtype=np.int64)
    for i in np.flatnonzero(up >= 0).tolist():  # upstream first: one pass
        level[i] = level[up[i]] + 1
    start, done = np.zeros(n), phase.end.copy()
    held = ~np.isnan(phase.release_rate)
    for depth in range(1, int(level.max(initial=0)) + 1):
        i = np.flatnonzero(level == depth)
        u = up[i]
        start[i] = start[u] + lat[u] + lag[i] / phase.first_rate[u]
        release = done[u] + lat[u] + lag[i] / np.where(held[i], phase.release_rate[i],
                                                        phase.first_rate[i])
        done[i] = np.where(held[i], release, np.maximum(start[i] + phase.end[i], release))
    return done + lat


__all__ = ["FluidTimes", "fluid_times"]
