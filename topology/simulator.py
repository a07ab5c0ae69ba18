"""Flow-level simulator: max-min fair sharing of every link, pipelining, failures.

Model
-----
Each `Transfer` is a flow of ``end - start`` bytes along its path. At any moment
the rates of the active flows are the max-min fair allocation (progressive
filling: raise every unfrozen flow's rate together; freeze the flows crossing an
arc that saturates) with one extra constraint for pipelining: a flow reading from
a relay that is still receiving those bytes may not overtake it. Once a flow is
within one chunk of its upstream's frontier it is *capped* and freezes together
with its upstream, so its rate is min(upstream rate, own fair share); it stays
capped until the upstream's last byte has arrived (the upstream's end plus its
path latency), so no relay forwards a byte it does not have yet. A flow
becomes ready when its upstream has delivered one chunk of its bytes (or
completed) and starts after the upstream path's latency; a reader's last byte
arrives one path latency after its flow ends. This gives the pipelined time
``S/B + depth·chunk/B`` at flow granularity: events are flow starts, completions,
catch-ups and external events, never chunks.

Relays whose upstream has ended are released when its last byte arrives; such
releases within a relative ``1e-6`` of each other happen together, at the last
of them (a few microseconds late at most, never early).

Events: ``Vanish(t, devices)`` aborts every flow from or to those devices and,
transitively, every flow fed by an aborted one; readers keep the prefix they got
and a *replanner* routes the rest from the surviving holders. ``Join(t, readers)``
asks the replanner for the new readers' transfers from the devices complete at t.

Cost per event: O(P·I) numpy work for P (flow, arc) pairs and I filling rounds
(distinct bottleneck levels, a handful for structured plans); events that fall
within a relative ``1e-9`` of each other are processed together, so symmetric
plans at 10,000 GPUs need a few hundred events.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from weightfabric.topology.plan import Interval, PlanError, Transfer

WAITING, SCHEDULED, ACTIVE, DONE, ABORTED = range(5)
#: Most chunks one transfer may be cut into. Events grow with the chunks per
#: transfer (1 B chunks of a 1 GB version never finish simulating), and a fetch
#: engine pays a request per chunk; a plan's chosen chunk stays far below this.
MAX_CHUNKS = 1 << 20
Replanner = Callable[[dict[str, list[Interval]], dict[str, list[Interval]]], list[Transfer]]


def check_chunk(chunk: float, transfers: Iterable[Transfer]) -> None:
    """Raise `PlanError` unless `chunk` is valid for every transfer.

    Raise `PlanError` unless `chunk` is at least one byte and cuts no transfer into more
    than `MAX_CHUNKS` chunks (the message names the smallest chunk that would do).
    """
    if isinstance(chunk, bool) or not isinstance(chunk, (int, float)) \
            or not math.isfinite(chunk) or chunk < 1:
        raise PlanError(f"the chunk must be a positive, finite number of bytes, got {chunk!r}")
    largest = max((t.nbytes for t in transfers), default=0)
    if largest > chunk * MAX_CHUNKS:
        raise PlanError(
            f"a chunk of {chunk:,} B cuts a {largest:,} B transfer into {math.ceil(largest / chunk):,} "
            f"chunks, more than the {MAX_CHUNKS:,} allowed; use a chunk of at least "
            f"{min_chunk(largest):,} B, or leave the chunk out to have one chosen")


def min_chunk(nbytes: int) -> int:
    """The smallest chunk that cuts `nbytes` into at most `MAX_CHUNKS` chunks."""
    return max(1, -(-int(nbytes) // MAX_CHUNKS))


@dataclass(frozen=True)
class Vanish:
    """At `time`, `devices` disappear (preempted): they neither serve nor read."""

    time: float
    devices: tuple[str, ...]


@dataclass(frozen=True)
class Join:
    """At `time`, `readers` start needing the whole version."""

    time: float
    readers: tuple[str, ...]


@dataclass
class SimResult:
    """What a simulation measured."""

    completion: dict[str, float]          # reader -> time its last byte arrived (s)
    delivered: dict[str, list[Interval]]  # reader -> byte ranges received, one per flow
    wan_bytes: float                      # bytes carried over WAN arcs
    events: int                           # event batches processed
    flows: int                            # flows simulated (including re-plans)
    max_utilisation: float                # highest arc load / capacity seen
    wall_seconds: float
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (t, bytes/s)

    @property
    def makespan(self) -> float:
        """When the last reader completes."""
        return max(self.completion.values(), default=0.0)


class Simulator:
    """Runs transfers on a graph; see the module docstring. Use `simulate`."""

    def __init__(self, graph: nx.DiGraph, chunk: int, size: int,
                 holders: dict[str, list[Interval]], replanner: Replanner | None) -> None:
        self.graph, self.chunk, self.size = graph, chunk, size
        self.holders = dict(holders)
        self.replanner = replanner
        self.arc_id: dict[tuple[str, str], int] = {}
        self.cap: list[float] = []
        self.arc_lat: list[float] = []
        self.arc_wan: list[bool] = []
        self.flows: list[Transfer] = []
        self.gone: set[str] = set()
        n = 0
        self.lo = self.hi = self.pos = self.rate = self.start_at = self.t_end = np.zeros(n)
        self.lag = self.lat = np.zeros(n)
        self.up = np.zeros(n, dtype=np.int64)
        self.status = np.zeros(n, dtype=np.int8)
        self.pair_flow = self.pair_arc = np.zeros(0, dtype=np.int64)
        self.wan_arcs = np.zeros(n)

    # --- flows --------------------------------------------------------------------
    def add(self, transfers: list[Transfer], now: float) -> None:
        """Start `transfers` at time `now`, after the flows already running."""
        offset = len(self.flows)
        latest: dict[str, list[int]] = defaultdict(list)  # flows still bringing bytes
        for i, f in enumerate(self.flows):
            if self.status[i] in (WAITING, SCHEDULED, ACTIVE) or (
                    self.status[i] == DONE and self.t_end[i] + self.lat[i] > now):
                latest[f.reader].append(i)
        ups, lags, los, his = [], [], [], []
        for t in transfers:
            if t.upstream is not None:
                up = t.upstream + offset
            else:  # the source may still be receiving these bytes from an older flow
                up = next((i for i in latest.get(t.source, ())
                           if self.flows[i].start < t.end and t.start < self.flows[i].end), -1)
            ups.append(up)
            lags.append(min(self.chunk, t.nbytes))
            los.append(t.start)
            his.append(t.end)
        arcs = [arc for t in transfers for arc in zip(t.path, t.path[1:], strict=False)]
        fresh = [arc for arc in dict.fromkeys(arcs) if arc not in self.arc_id]
        succ = self.graph.succ
        data = [succ[u][v] for u, v in fresh]
        capacities = _capacities(fresh, data)  # raises before anything is recorded
        self.arc_id.update(zip(fresh, range(len(self.cap), len(self.cap) + len(fresh)),
                               strict=True))
        self.cap.extend(capacities)
        self.arc_lat.extend(d["latency"] for d in data)
        self.arc_wan.extend(d.get("tier") == "wan" for d in data)
        pa = np.fromiter(map(self.arc_id.__getitem__, arcs), dtype=np.int64, count=len(arcs))
        own = np.repeat(np.arange(len(transfers)), [max(len(t.path) - 1, 0) for t in transfers])
        # summed arc by arc, in path order, as a flow's latency always was
        lats = np.bincount(own, weights=np.array(self.arc_lat, float)[pa],
                           minlength=len(transfers))
        wans = np.bincount(own, weights=np.array(self.arc_wan, float)[pa],
                           minlength=len(transfers))
        pf = own + offset
        self.flows.extend(transfers)
        grow = len(transfers)
        self.lo = np.concatenate([self.lo, np.array(los, float)])
        self.hi = np.concatenate([self.hi, np.array(his, float)])
        self.lag = np.concatenate([self.lag, np.array(lags, float)])
        self.lat = np.concatenate([self.lat, lats])
        self.wan_arcs = np.concatenate([self.wan_arcs, wans])
        self.up = np.concatenate([self.up, np.array(ups, dtype=np.int64)])
        for name in ("pos", "rate", "t_end"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grow)]))
        self.start_at = np.concatenate([self.start_at, np.full(grow, np.inf)])
        self.status = np.concatenate([self.status, np.zeros(grow, dtype=np.int8)])
        self.pair_flow = np.concatenate([self.pair_flow, pf])
        self.pair_arc = np.concatenate([self.pair_arc, pa])
        self.capacity = np.array(self.cap, float)
        self._now_added = now

    # --- rates --------------------------------------------------------------------
    def _fill(self, active: np.ndarray, capped: np.ndarray) -> np.ndarray:
        return max_min_rates(self.pair_flow, self.pair_arc, self.capacity, self.up, active,
                             capped)[0]

    # --- events -------------------------------------------------------------------
    def _vanish(self, devices: Iterable[str], now: float) -> None:
        devices = set(devices)
        self.gone |= devices
        pending = np.isin(self.status, (WAITING, SCHEDULED, ACTIVE))
        src = np.array([f.source in devices or f.reader in devices for f in self.flows])
        abort = pending & src
        while True:
            more = pending & ~abort & (self.up >= 0) & abort[np.maximum(self.up, 0)]
            if not more.any():
                break
            abort |= more
        missing: dict[str, list[Interval]] = defaultdict(list)
        for i in np.flatnonzero(abort):
            f = self.flows[i]
            if f.reader not in devices:
                missing[f.reader].append((int(round(f.start + self.pos[i])), f.end))
        self.status[abort] = ABORTED
        for d in devices:
            self.holders.pop(d, None)
        self._replan({r: [iv for iv in ivs if iv[1] > iv[0]] for r, ivs in missing.items()},
                     now)

    def _join(self, readers: Iterable[str], now: float) -> None:
        self._replan({r: [(0, self.size)] for r in readers if r not in self.gone}, now)

    def _replan(self, missing: dict[str, list[Interval]], now: float) -> None:
        missing = {r: ivs for r, ivs in missing.items() if ivs}
        if not missing:
            return
        if self.replanner is None:
            raise RuntimeError("an event needs a re-plan but no replanner was given")
        holders = dict(self.holders)
        for r in self._complete_readers():
            holders.setdefault(r, [(0, self.size)])
        self.add(self.replanner(holders, missing), now)

    def _complete_readers(self) -> list[str]:
        open_readers = {self.flows[i].reader for i in
                        np.flatnonzero(np.isin(self.status, (WAITING, SCHEDULED, ACTIVE)))}
        got: dict[str, int] = defaultdict(int)
        for i, f in enumerate(self.flows):
            if self.status[i] == DONE:
                got[f.reader] += f.nbytes
            elif self.status[i] == ABORTED:
                got[f.reader] += int(self.pos[i])
        return [r for r, n in got.items()
                if r not in open_readers and r not in self.gone and n >= self.size]

    # --- main loop ----------------------------------------------------------------
    def run(self, events: list[Vanish | Join]) -> SimResult:
        """Run the flows, applying `events` at their times, until none is left to run."""
        started = time.perf_counter()
        pending = sorted(events, key=lambda e: e.time)
        t, batches, worst = 0.0, 0, 0.0
        timeline: list[tuple[float, float]] = []
        while True:
            while pending and pending[0].time <= t * (1 + 1e-12) + 1e-15:
                e = pending.pop(0)
                (self._vanish(e.devices, t) if isinstance(e, Vanish)
                 else self._join(e.readers, t))
            st = self.status
            up = np.maximum(self.up, 0)
            has_up = self.up >= 0
            frontier = self.lo[up] + self.pos[up]
            eps = 1e-6 * self.lag + 1e-3
            waiting = st == WAITING
            ready = waiting & (~has_up | (st[up] == DONE)
                               | ((st[up] == ACTIVE) & (frontier + eps >= self.lo + self.lag)))
            # one chunk (or all) of the upstream's bytes lands its path latency later
            arrival = np.where(has_up & (st[up] == DONE),
                               np.maximum(t, self.t_end[up] + self.lat[up]),
                               t + np.where(has_up, self.lat[up], 0.0))
            self.start_at[ready] = arrival[ready]
            st[ready] = SCHEDULED
            go = (st == SCHEDULED) & (self.start_at <= t * (1 + 1e-12) + 1e-15)
            st[go] = ACTIVE
            active = st == ACTIVE
            # a relay's bytes are still on their way until its flow's path latency
            # after that flow ends: until then its readers stay behind its frontier
            arriving = (st[up] == DONE) & (self.t_end[up] + self.lat[up] > t * (1 + 1e-12))
            up_active = has_up & ((st[up] == ACTIVE) | arriving)
            gap = frontier - (self.lo + self.pos + self.lag)
            capped = active & up_active & (gap <= eps)
            if not active.any() and not (st == SCHEDULED).any():
                if pending:
                    t = pending[0].time
                    continue
                if waiting.any() and (st == WAITING).any():
                    raise RuntimeError("simulation stalled: flows wait on bytes that never come")
                break
            rate = self._fill(active, capped)
            self.rate = rate
            load = np.bincount(self.pair_arc, weights=rate[self.pair_flow],
                               minlength=len(self.capacity))
            worst = max(worst, float(np.max(load / self.capacity)) if load.size else 0.0)
            timeline.append((t, float(rate[active].sum())))
            dts = [np.inf]
            left = self.hi - self.lo - self.pos
            m = active & (rate > 0)
            if m.any():
                dts.append(np.min(left[m] / rate[m]))
            m = active & up_active & ~capped & (rate > rate[up])
            if m.any():
                dts.append(np.min(gap[m] / (rate[m] - rate[up][m])))
            m = (st == WAITING) & up_active & (rate[up] > 0)
            if m.any():
                need = self.lo + self.lag - frontier
                dts.append(np.min(np.maximum(need[m], 0) / rate[up][m]))
            m = st == SCHEDULED
            if m.any():
                dts.append(np.min(self.start_at[m]) - t)
            m = capped & arriving
            if m.any():  # releases within 1e-6 of the first wait for the last of them
                release = self.t_end[up][m] + self.lat[up][m]
                first = np.min(release)
                dts.append(np.max(release[release <= first * (1 + 1e-6)]) - t)
            if pending:
                dts.append(pending[0].time - t)
            dt = max(min(dts), 0.0)
            if not np.isfinite(dt):
                raise RuntimeError("simulation stalled: no flow can make progress")
            self.pos[active] += rate[active] * dt
            t += dt
            # pipelining: a capped flow never passes its upstream's frontier
            cap_pos = self.lo[up] + self.pos[up] - self.lag - self.lo
            self.pos = np.where(capped, np.minimum(self.pos, np.maximum(cap_pos, 0)), self.pos)
            finished = active & (self.hi - self.lo - self.pos <= 1e-9 * self.hi + 1e-3)
            self.pos[finished] = (self.hi - self.lo)[finished]
            st[finished] = DONE
            self.t_end[finished] = t
            batches += 1
        return self._result(batches, worst, timeline, time.perf_counter() - started)

    def _result(self, batches: int, worst: float, timeline, wall: float) -> SimResult:
        completion: dict[str, float] = {}
        delivered: dict[str, list[Interval]] = defaultdict(list)
        for i, f in enumerate(self.flows):
            if self.status[i] == DONE:
                delivered[f.reader].append((f.start, f.end))
                if f.reader not in self.gone:
                    completion[f.reader] = max(completion.get(f.reader, 0.0),
                                               self.t_end[i] + self.lat[i])
            elif self.status[i] == ABORTED and self.pos[i] > 0:
                delivered[f.reader].append((f.start, int(round(f.start + self.pos[i]))))
        wan = float(np.sum(self.pos * self.wan_arcs))
        return SimResult(completion=completion, delivered=dict(delivered), wan_bytes=wan,
                         events=batches, flows=len(self.flows), max_utilisation=worst,
                         wall_seconds=wall, timeline=timeline)


def max_min_rates(pair_flow: np.ndarray, pair_arc: np.ndarray, capacity: np.ndarray,
                  up: np.ndarray, active: np.ndarray, capped: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Max-min fair rates of the `active` flows by progressive filling.

    Every unfrozen flow's rate rises together; the flows crossing an arc that saturates
    freeze, and a `capped` flow freezes with its upstream (``up[i]``, -1 for none), so its
    rate is min(upstream's, own fair share). Flow ``pair_flow[k]`` crosses arc
    ``pair_arc[k]``. Returns the rates and each arc's capacity left over.
    """
    rate = np.zeros(len(up))
    keep = active[pair_flow]
    pf, pa = pair_flow[keep], pair_arc[keep]
    residual = capacity.copy()
    unfrozen = active.copy()
    upstream = np.where(up >= 0, up, np.arange(len(up)))
    capped_idx = np.flatnonzero(capped)
    n_arcs = len(residual)
    while True:
        live = unfrozen[pf]
        if not live.any():
            break
        counts = np.bincount(pa[live], minlength=n_arcs)
        used = counts > 0
        inc = np.min(residual[used] / counts[used])
        rate[unfrozen] += inc
        residual[used] -= inc * counts[used]
        sat = used & (residual <= 1e-9 * capacity)
        unfrozen[pf[live & sat[pa]]] = False
        while capped_idx.size:
            follow = capped_idx[unfrozen[capped_idx] & ~unfrozen[upstream[capped_idx]]]
            if not follow.size:
                break
            unfrozen[follow] = False
    return rate, residual


def _capacities(arcs: list[tuple[str, str]], data: list[dict]) -> list[float]:
    """The bandwidth of each arc (`_capacity`, checked at once where all are valid)."""
    bandwidth = [d["bandwidth"] for d in data]
    if all(isinstance(b, (int, float)) for b in bandwidth):
        values = np.array(bandwidth, dtype=float)
        if np.all(np.isfinite(values) & (values > 0)):
            return values.tolist()
    return [_capacity(arc, d) for arc, d in zip(arcs, data, strict=True)]


def _capacity(arc: tuple[str, str], data: dict) -> float:
    """The arc's bandwidth.

    `PlanError` unless it is positive and finite (max-min filling never ends on a negative
    capacity and has no fair share of a zero one).
    """
    bandwidth = data["bandwidth"]
    if isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0:
        return float(bandwidth)
    what = ("the storage service's bandwidth" if data.get("tier") == "storage"
            else f"the bandwidth of link {arc[0]} -> {arc[1]}")
    raise PlanError(f"{what} must be a positive, finite number of bytes/s, got {bandwidth!r}")


def simulate(graph: nx.DiGraph, transfers: list[Transfer], *, chunk: int, size: int,
             holders: dict[str, list[Interval]] | None = None,
             events: Iterable[Vanish | Join] = (), replanner: Replanner | None = None
             ) -> SimResult:
    """Simulate `transfers` on `graph` at flow level.

    Args:
        graph (networkx.DiGraph): Arcs with ``bandwidth`` (bytes/s), ``latency`` (s) and
            ``tier``.
        transfers (list of Transfer): A plan's transfers (upstream first), e.g. `Plan.transfers`
            or a baseline.
        chunk (int): Pipelining unit: a relay forwards a chunk once it has it all.
        size (int): Bytes of the version (for joins and completeness).
        holders (dict): Devices holding bytes at time 0 (needed by re-plans after events).
        events (iterable of Vanish or Join): External events.
        replanner (callable (holders, missing) -> list of Transfer): Called after an event with
            the devices holding the whole version and what each affected reader still misses.

    Returns:
        SimResult

    Raises:
        PlanError: `chunk` is not positive, or cuts a transfer into more than `MAX_CHUNKS`
            chunks; or a link the transfers use has no positive, finite bandwidth.
        RuntimeError: An event needs a re-plan and no replanner was given, or flows stall.
    """
    transfers = list(transfers)
    check_chunk(chunk, transfers)
    sim = Simulator(graph, chunk, size, holders or {}, replanner)
    sim.add(transfers, 0.0)
    return sim.run(list(events))
