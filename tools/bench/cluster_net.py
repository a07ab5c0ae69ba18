"""An emulated cluster network: one network namespace per node, built from a cluster YAML.

`emulate` turns a `Cluster` into namespaces joined by veth pairs shaped with ``tc``, so
that real processes (started with `EmulatedCluster.exec_prefix`) talk over TCP at the
cluster's bandwidths times ``scale``. Needs Linux, root and iproute2 (`unavailable`).

Namespaces (``d`` = 1-based datacenter index in file order, ``k`` = leaf index in the
datacenter, ``n`` = the node's index in its datacenter, file order; both counted over
the whole YAML, so a `nodes` subset keeps every address):

- ``{prefix}-d{d}``: the datacenter's router (its spine and WAN gateway), always made;
- ``{prefix}-d{d}l{k}``: leaf ``k``, only where the datacenter is oversubscribed
  (``network.oversubscription > 1``) and the leaf has a node that is emulated;
- ``{prefix}-d{d}n{n}``: a node, for each node of the YAML (or of `nodes`).

Links (each one veth pair, each end shaped on its egress, so both directions are):

- **node link**: the node's ``eth0`` to port ``n{n}`` of leaf ``k``'s bridge, at the
  node's total NIC bandwidth (``count x bandwidth``) x scale. The stores are host-memory
  processes with one TCP endpoint each, so a node's rails cannot carry separate streams
  to separate addresses; one link of the summed rate is what the planner's fluid model
  sees when every rail carries one stream. Delay: the NIC latency (plus the network's
  ``latency`` where there is no leaf namespace).
- **leaf uplink** (oversubscribed datacenters): leaf ``k``'s ``spine`` to the router's
  ``l{k}``, at (sum of the NIC bandwidth of the leaf's ``nodes_per_leaf`` nodes) /
  oversubscription x scale, delay ``network.latency``. Where the datacenter is not
  oversubscribed, leaf ``k``'s bridge ``br{k}`` sits in the router namespace instead:
  the fabric between leaves is not shaped (non-blocking).
- **WAN link** ``i`` of the YAML's ``wan`` list: router ``w{i}`` to router ``w{i}``, at the
  WAN bandwidth x scale, delay its latency.

Latencies are physical and not scaled. Each end gets a ``tbf`` (rate; burst
``max(16 KiB, 10 ms at the rate)``: a shaper whose timer fires late on a busy host
loses no capacity, and a transfer of a few MB is still mostly shaped; limit
``max(256 KiB, 20 ms at the rate) + 2 x delay at the rate`` bytes: switches' buffers
are shallow, and a deep queue would add its delay to every request of a pipelined
read). Links run jumbo frames (MTU 9000) and every namespace keeps a TCP window over
idle periods (``tcp_slow_start_after_idle=0``), as datacenter hosts are tuned.
The host itself moves well under a cluster's bandwidth (on a 2-core machine
a tbf-shaped veth path held 8-200 MB/s within 5 %, but topped out near 0.7 GB/s):
choose ``scale`` so that the fastest link stays below what the host can carry.
Where a link has a latency and the kernel has ``sch_netem``, ``netem delay ... rate ...``
replaces the tbf; without ``sch_netem`` the rate is shaped and the delay is not, unless
``emulate(..., delay_line=True)``: then each WAN link runs through a namespace of its own,
``w{i}``, where a delay line (`tools.bench.delay_line`) holds every frame for the link's
latency (`EmulatedCluster.shaping` says which, and why).

Addresses (IPv4; IPv6 is not configured on any link, so counters see no IPv6 chatter):

- leaf ``k`` of datacenter ``d``: bridge subnet ``10.d.(k+1).0/24``, gateway ``.1`` on the
  bridge, the node at position ``j`` in the leaf ``10.d.(k+1).(j+2)``;
- leaf uplinks: ``10.d.0.(2k)/31`` (router end), ``10.d.0.(2k+1)/31`` (leaf end);
- WAN link ``i``: ``10.0.i.0/31`` (first datacenter of ``between``), ``10.0.i.1/31``.

Routes: nodes and leaves default to their gateway; a router reaches datacenter ``e``'s
``10.e.0.0/16`` over the direct WAN link (the widest, if several), else along the WAN
links' maximum spanning tree (widest links first, then lowest latency): every path it
routes is a widest path and hop-by-hop routing cannot loop. IP forwarding is on in
router and leaf namespaces. Relaying through a third datacenter on purpose is the
application's business.

Every exit of `emulate` (normal, exception, KeyboardInterrupt) deletes its namespaces,
and their veths go with them; it first deletes leftovers with its prefix
(`remove_leftovers`). Nothing is made in, or taken from, the root namespace. A namespace
still used by a process lives on (without its name) until that process exits: stop the
processes inside before leaving the ``with`` block.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightfabric.topology.schema import Cluster, Node, WanLink

MIN_BURST = 16 << 10
"""Smallest tbf burst, bytes."""
BURST_SECONDS = 0.01
"""tbf burst, in seconds at the rate (at least `MIN_BURST`)."""
MIN_LIMIT = 8 << 20
"""Smallest queue of `qdisc`'s default, bytes."""
MAX_LIMIT = 1 << 30
"""Largest queue, bytes (tc takes 32 bits)."""
QUEUE_SECONDS = 0.5
"""`qdisc`'s default queue room, in seconds at the link's rate (before the delay's share)."""
SWITCH_QUEUE = (256 << 10, 0.02)
"""An emulated cluster's queues: at least 256 KiB, else 20 ms at the rate (switches'
buffers are shallow; a deep queue adds its delay to every request of a pipelined
read, which a real fabric does not)."""
MTU = 9000
"""Every link's MTU: jumbo frames, as datacenter fabrics run (fewer packets per byte for
the host to shape and copy, 0.6 % of headers instead of 3.6 %)."""
TCP_SYSCTLS = ("net.ipv4.tcp_slow_start_after_idle=0",)
"""Set in every namespace: a connection idle while its reader waits for a relay's next
chunk keeps its window (as tuned hosts do), instead of starting slow again."""
_PREFIX = re.compile(r"[a-z][a-z0-9]{0,7}")


# --- shared with `fabric bench crossdc` ------------------------------------------------

def unavailable() -> str | None:
    """Why namespaces cannot be emulated here (not Linux, not root, no iproute2), or None."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (ip netns add, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns is unavailable: {probe.stderr.strip()}"
    return None


def skipped(command: str, *, as_json: bool) -> bool:
    """Print why `command` cannot run here (``{"skipped": why}`` with `as_json`); True then."""
    reason = unavailable()
    if reason is not None:
        print(json.dumps({"skipped": reason}) if as_json else f"{command}: skipped: {reason}")
    return reason is not None


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt: every ``finally`` runs (processes, namespaces)."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sh(*args: str, stdin: str | None = None) -> str:
    """Run a command and return its stdout.

    Raises:
        RuntimeError: it failed; the message holds the command, its stderr and, for a
            ``-batch -`` command, the failing line of `stdin`.
    """
    done = subprocess.run(args, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        err = done.stderr.strip()
        line = re.search(r"Command failed -:(\d+)", err)
        if line and stdin is not None:
            err += f" (line: {stdin.splitlines()[int(line.group(1)) - 1]!r})"
        raise RuntimeError(f"{' '.join(args)} failed (exit {done.returncode}): {err}")
    return done.stdout


def netem_missing(ns: str) -> str | None:
    """Why ``netem`` cannot delay packets in namespace `ns` (tried on its ``lo``), or None."""
    try:
        sh("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except RuntimeError as e:
        if "unknown" not in str(e):
            raise
        return "this kernel has no sch_netem (tc netem: unknown qdisc): delays are not emulated"
    sh("tc", "-n", ns, "qdisc", "del", "dev", "lo", "root")
    return None


def qdisc(rate: float, delay: float, *, netem: bool,
          queue: tuple[int, float] = (MIN_LIMIT, QUEUE_SECONDS)) -> list[str]:
    """The ``tc qdisc add dev X root`` arguments that shape one link end.

    Args:
        rate: bytes/s.  delay: seconds added on this end's egress.
        netem: the kernel has netem; with a delay, netem shapes both, else tbf the rate.
        queue: (least bytes, seconds at the rate) of queue, before the delay's share.
    """
    least, seconds = queue
    limit = int(min(max(least, rate * seconds) + 2 * delay * rate, MAX_LIMIT))
    bits = f"{max(int(rate * 8), 8000)}bit"
    if netem and delay > 0:
        return ["netem", "delay", f"{delay * 1e6:.0f}us", "rate", bits,
                "limit", str(max(1000, limit // 1500))]
    return ["tbf", "rate", bits, "burst", str(int(max(MIN_BURST, rate * BURST_SECONDS))),
            "limit", str(limit)]


def link_stats(ns: str) -> dict[str, tuple[int, int]]:
    """(tx bytes, rx bytes) of every interface of namespace `ns`."""
    out = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show"))
    return {i["ifname"]: (int(i["stats64"]["tx"]["bytes"]), int(i["stats64"]["rx"]["bytes"]))
            for i in out}


def qdisc_drops(ns: str) -> dict[str, int]:
    """Packets dropped so far by the root qdisc of every interface of namespace `ns`."""
    out = json.loads(sh("tc", "-n", ns, "-s", "-j", "qdisc", "show"))
    return {q["dev"]: int(q.get("drops", 0)) for q in out if q.get("root")}


def tcp_retransmits(ns: str) -> int:
    """TCP segments namespace `ns` has retransmitted so far (``RetransSegs``, /proc/net/snmp)."""
    lines = [line.split() for line in sh("ip", "netns", "exec", ns, "cat", "/proc/net/snmp")
             .splitlines() if line.startswith("Tcp:")]
    names, values = lines[0], lines[1]
    return int(values[names.index("RetransSegs")])


# --- the emulated cluster --------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class EmulatedNode:
    """One node of the emulated cluster."""

    name: str
    namespace: str
    address: str
    """IPv4 address, reachable from every other node's namespace."""
    datacenter: str
    leaf: int
    """Index of its leaf in its datacenter (``nodes_per_leaf`` consecutive nodes)."""
    rate: float
    """Its link's rate per direction, bytes/s (NIC total x scale)."""


@dataclass(frozen=True, kw_only=True)
class _End:
    label: str
    ns: str
    dev: str


@dataclass(frozen=True, kw_only=True)
class _Veth:
    """A veth pair shaped at `rate` (bytes/s) and `delay` (s) on both ends."""

    a: _End
    b: _End
    rate: float
    delay: float
    wan: bool = False
    line_ns: str | None = None
    """The namespace of the link's delay line, where one may replace netem (WAN links)."""


@dataclass
class _Plan:
    """What `emulate` makes: namespaces, veths, and each namespace's ``ip`` lines.

    `ip` runs before the qdiscs are added, `up` after: a veth that comes up with its
    qdisc in place gets its carrier at once, not up to a second later.
    """

    namespaces: list[str] = field(default_factory=list)
    forwarding: list[str] = field(default_factory=list)
    veths: list[_Veth] = field(default_factory=list)
    ip: dict[str, list[str]] = field(default_factory=dict)
    up: dict[str, list[str]] = field(default_factory=dict)
    nodes: dict[str, EmulatedNode] = field(default_factory=dict)

    def add_ns(self, ns: str, *, forward: bool = False) -> None:
        self.namespaces.append(ns)
        self.ip[ns] = ["link set lo up"]
        self.up[ns] = []
        if forward:
            self.forwarding.append(ns)

    def add_veth(self, veth: _Veth, a_addr: str, b_addr: str | None = None) -> None:
        self.veths.append(veth)
        for end, addr in ((veth.a, a_addr), (veth.b, b_addr)):
            self.ip[end.ns].append(f"link set {end.dev} addrgenmode none mtu {MTU}")
            if addr is not None:
                self.ip[end.ns].append(f"addr add {addr} dev {end.dev}")
            self.up[end.ns].append(f"link set {end.dev} up")

    def add_bridge(self, ns: str, bridge: str, address: str) -> None:
        self.ip[ns] += [f"link add {bridge} mtu {MTU} type bridge",
                        f"link set {bridge} addrgenmode none",
                        f"addr add {address} dev {bridge}", f"link set {bridge} up"]

    def add_route(self, ns: str, route: str) -> None:
        self.up[ns].append(f"route add {route}")


@dataclass(frozen=True, kw_only=True)
class EmulatedCluster:
    """The namespaces `emulate` made; valid inside its ``with`` block."""

    nodes: dict[str, EmulatedNode]
    shaping: dict[str, Any]
    """``{"qdisc", "delay_emulated", "why", "congestion", "scale"}``: how links are shaped
    and which TCP congestion control the namespaces run."""
    namespaces: tuple[str, ...]
    """Every namespace made, routers and leaves included."""
    _veths: tuple[_Veth, ...] = field(repr=False)

    def exec_prefix(self, node: str) -> list[str]:
        """The command prefix that runs a process on `node` (inside its namespace)."""
        return ["ip", "netns", "exec", self._node(node).namespace]

    def address(self, node: str) -> str:
        """`node`'s IPv4 address, reachable from every other node."""
        return self._node(node).address

    def wan_bytes(self) -> dict[str, int]:
        """Bytes sent so far over each WAN link, per direction: ``{"dc-a->dc-b": n, ...}``.

        Read from the veth tx counters: Ethernet frames, control traffic included.
        """
        return self._tx_bytes([v for v in self._veths if v.wan])

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent so far over every shaped link, per direction (diagnostics).

        Keys ``"a->b"``: a node is named as in the YAML, leaf ``k`` of datacenter ``dc`` is
        ``dc/leaf{k}``, its router ``dc/spine``; WAN links are keyed as in `wan_bytes`.
        """
        return self._tx_bytes(list(self._veths))

    def drops(self) -> dict[str, int]:
        """Packets dropped so far by each shaped link's queue, per direction.

        Keyed as `link_bytes` (diagnostics: where the emulated network lost packets).
        """
        spaces = sorted({end.ns for v in self._veths for end in (v.a, v.b)})
        stats = dict(zip(spaces, _parallel([(qdisc_drops, ns) for ns in spaces]), strict=True))
        return {f"{src.label}->{dst.label}": stats[src.ns].get(src.dev, 0)
                for v in self._veths for src, dst in ((v.a, v.b), (v.b, v.a))}

    def retransmits(self) -> dict[str, int]:
        """TCP segments each node has retransmitted so far (its namespace's ``RetransSegs``).

        A segment dropped past a link and sent again crosses that link twice.
        """
        names = list(self.nodes)
        counts = _parallel([(tcp_retransmits, self.nodes[n].namespace) for n in names])
        return dict(zip(names, counts, strict=True))

    def _node(self, node: str) -> EmulatedNode:
        try:
            return self.nodes[node]
        except KeyError:
            raise KeyError(f"node {node!r} is not emulated; emulated: "
                           f"{', '.join(self.nodes)}") from None

    def _tx_bytes(self, veths: list[_Veth]) -> dict[str, int]:
        spaces = sorted({end.ns for v in veths for end in (v.a, v.b)})
        stats = dict(zip(spaces, _parallel([(link_stats, ns) for ns in spaces]), strict=True))
        out = {}
        for v in veths:
            out[f"{v.a.label}->{v.b.label}"] = stats[v.a.ns][v.a.dev][0]
            out[f"{v.b.label}->{v.a.label}"] = stats[v.b.ns][v.b.dev][0]
        return out


@contextlib.contextmanager
def emulate(cluster: Cluster, *, scale: float, nodes: Sequence[str] | None = None,
            prefix: str = "wfc", delay_line: bool = False,
            congestion: str | None = None) -> Iterator[EmulatedCluster]:
    """Build `cluster`'s network in namespaces (see the module docstring); remove it after.

    Args:
        cluster: the cluster; every emulated node needs ``nics``.
        scale: factor on every bandwidth (the host moves a few GB/s, not a cluster's).
        nodes: the nodes to emulate (default all); routers are made for every datacenter.
        prefix: namespace name prefix, a lowercase letter and up to 7 letters or digits.
        delay_line: where the kernel has no netem, delay each WAN link by its latency with
            a delay line (`tools.bench.delay_line`: a process per link, a few microseconds
            of CPU per frame); the other links' latencies stay unemulated.
        congestion: TCP congestion control in every namespace (``cubic``, ``bbr``, ...;
            default: what a new namespace gets here, the host's default); `shaping`
            names the one in use.

    Yields:
        The `EmulatedCluster`.

    Raises:
        ValueError: a bad argument, or a cluster this addressing cannot hold.
        RuntimeError: it cannot run here (the reason from `unavailable`), or a command
            failed (the command and its stderr).
    """
    plan = _plan(cluster, scale=scale, nodes=nodes, prefix=prefix)
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    if congestion is not None:
        _check_congestion(congestion)
    remove_leftovers(prefix)
    lines: list[subprocess.Popen] = []
    try:
        shaping = _build(plan, delay_line=delay_line, processes=lines,
                         congestion=congestion)
        yield EmulatedCluster(nodes=plan.nodes, shaping={**shaping, "scale": scale},
                              namespaces=tuple(plan.namespaces), _veths=tuple(plan.veths))
    finally:
        for proc in lines:   # a process inside would keep its namespace alive
            proc.kill()
            proc.wait()
        _delete(plan.namespaces)


def remove_leftovers(prefix: str = "wfc") -> list[str]:
    """Delete the namespaces named ``{prefix}-...`` (left by a killed run); return their names."""
    _check_prefix(prefix)
    names = [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]
    mine = [n for n in names if n.startswith(f"{prefix}-")]
    _delete(mine)
    return mine


def _check_congestion(name: str) -> None:
    """A namespace's TCP congestion control must be one the host allows namespaces."""
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    if name not in allowed:
        raise ValueError(
            f"TCP congestion control {name!r} is not allowed in network namespaces here "
            f"(net.ipv4.tcp_allowed_congestion_control = {' '.join(allowed)}; available: "
            f"{Path('/proc/sys/net/ipv4/tcp_available_congestion_control').read_text().strip()}"
            "): add it to the allowed list first, or choose another")


def _check_prefix(prefix: str) -> None:
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"prefix must be a lowercase letter and up to 7 letters or digits, "
                         f"got {prefix!r}")


def _delete(namespaces: Sequence[str]) -> None:
    if namespaces:
        sh("ip", "-force", "-batch", "-", stdin="".join(f"netns del {ns}\n" for ns in namespaces))


def _plan(cluster: Cluster, *, scale: float, nodes: Sequence[str] | None,
          prefix: str) -> _Plan:
    """Namespaces, links, addresses and routes, without touching the system."""
    _check_prefix(prefix)
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    every = cluster.nodes()
    wanted = {n.name for n in every} if nodes is None else set(nodes)
    unknown = wanted - {n.name for n in every}
    if unknown:
        raise ValueError(f"no such nodes in cluster {cluster.name!r}: {', '.join(sorted(unknown))}")
    if len(cluster.datacenters) > 254 or len(cluster.wan) > 255:
        raise ValueError("the addressing holds at most 254 datacenters and 255 WAN links")
    plan = _Plan()
    index = {dc.name: d for d, dc in enumerate(cluster.datacenters, 1)}
    for dc in cluster.datacenters:
        d = index[dc.name]
        router = f"{prefix}-d{d}"
        plan.add_ns(router, forward=True)
        net = dc.network
        members = [n for n in every if n.datacenter == dc.name]
        per_leaf = net.nodes_per_leaf
        leaves = [members[i:i + per_leaf] for i in range(0, len(members), per_leaf)]
        if per_leaf > 253 or len(leaves) > 127:
            raise ValueError(f"datacenter {dc.name!r}: the addressing holds at most 127 leaves "
                             "of 253 nodes")
        for k, leaf_nodes in enumerate(leaves):
            chosen = [(j, n) for j, n in enumerate(leaf_nodes) if n.name in wanted]
            if not chosen:
                continue
            label = f"{dc.name}/leaf{k}"
            if net.oversubscription > 1:
                switch, bridge, extra_delay = f"{prefix}-d{d}l{k}", "br0", 0.0
                plan.add_ns(switch, forward=True)
                uplink = sum(_nic_total(n) for n in leaf_nodes) / net.oversubscription
                plan.add_veth(_Veth(a=_End(label=f"{dc.name}/spine", ns=router, dev=f"l{k}"),
                                    b=_End(label=label, ns=switch, dev="spine"),
                                    rate=uplink * scale, delay=net.latency),
                              f"10.{d}.0.{2 * k}/31", f"10.{d}.0.{2 * k + 1}/31")
                plan.add_route(switch, f"default via 10.{d}.0.{2 * k}")
                plan.add_route(router, f"10.{d}.{k + 1}.0/24 via 10.{d}.0.{2 * k + 1}")
            else:
                switch, bridge, extra_delay = router, f"br{k}", net.latency
            plan.add_bridge(switch, bridge, f"10.{d}.{k + 1}.1/24")
            for j, node in chosen:
                if node.type.nics is None:
                    raise ValueError(f"node {node.name!r} has no nics: it cannot be on the "
                                     "network; leave it out with nodes=")
                n = k * per_leaf + j
                ns, rate = f"{prefix}-d{d}n{n}", _nic_total(node) * scale
                plan.add_ns(ns)
                address = f"10.{d}.{k + 1}.{j + 2}"
                plan.add_veth(_Veth(a=_End(label=node.name, ns=ns, dev="eth0"),
                                    b=_End(label=label, ns=switch, dev=f"n{n}"),
                                    rate=rate, delay=node.type.nics.latency + extra_delay),
                              f"{address}/24")
                plan.ip[switch].append(f"link set n{n} master {bridge}")
                plan.add_route(ns, f"default via 10.{d}.{k + 1}.1")
                plan.nodes[node.name] = EmulatedNode(
                    name=node.name, namespace=ns, address=address, datacenter=dc.name, leaf=k,
                    rate=rate)
    for i, link in enumerate(cluster.wan):
        a, b = link.between
        plan.add_veth(_Veth(a=_End(label=a, ns=f"{prefix}-d{index[a]}", dev=f"w{i}"),
                            b=_End(label=b, ns=f"{prefix}-d{index[b]}", dev=f"w{i}"),
                            rate=link.bandwidth * scale, delay=link.latency, wan=True,
                            line_ns=f"{prefix}-w{i}"),
                      f"10.0.{i}.0/31", f"10.0.{i}.1/31")
    for (src, dst), i in _wan_next_hops(cluster).items():
        peer = 1 if cluster.wan[i].between[0] == src else 0
        plan.add_route(f"{prefix}-d{index[src]}", f"10.{index[dst]}.0.0/16 via 10.0.{i}.{peer}")
    return plan


def _nic_total(node: Node) -> float:
    nics = node.type.nics
    return 0.0 if nics is None else nics.count * nics.bandwidth


def _wan_next_hops(cluster: Cluster) -> dict[tuple[str, str], int]:
    """(source, destination) datacenter -> index of the WAN link its router sends over."""
    names = [dc.name for dc in cluster.datacenters]
    wan = list(enumerate(cluster.wan))

    def best(links: list[tuple[int, WanLink]]) -> list[tuple[int, WanLink]]:
        return sorted(links, key=lambda il: (-il[1].bandwidth, il[1].latency, il[0]))

    # the maximum spanning tree (Kruskal): its paths are widest paths
    group = {name: name for name in names}

    def root(name: str) -> str:
        while group[name] != name:
            name = group[name]
        return name

    tree: dict[str, list[tuple[str, int]]] = {name: [] for name in names}
    for i, link in best(wan):
        a, b = link.between
        if root(a) != root(b):
            group[root(a)] = root(b)
            tree[a].append((b, i))
            tree[b].append((a, i))
    hops: dict[tuple[str, str], int] = {}
    for src in names:
        first: dict[str, int] = {}  # tree: destination -> first link from src
        stack = [(src, -1)]
        while stack:
            at, via = stack.pop()
            for nxt, i in tree[at]:
                if nxt != src and nxt not in first:
                    first[nxt] = i if via < 0 else via
                    stack.append((nxt, first[nxt]))
        for dst in names:
            if dst == src:
                continue
            direct = best([(i, w) for i, w in wan if set(w.between) == {src, dst}])
            if direct:
                hops[src, dst] = direct[0][0]
            elif dst in first:
                hops[src, dst] = first[dst]
    return hops


def _parallel(calls: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Run ``fn(*args)`` for each ``(fn, *args)`` on threads; raise the first failure."""
    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(calls))) as pool:
        futures = [pool.submit(fn, *args) for fn, *args in calls]
        return [f.result() for f in futures]


def _batch(tool: str, ns: str, lines: list[str]) -> str:
    """Run `lines` with ``ip`` or ``tc`` in namespace `ns`, in one process."""
    return sh(tool, "-n", ns, "-batch", "-", stdin="\n".join(lines) + "\n")


def _build(plan: _Plan, *, delay_line: bool, processes: list[subprocess.Popen],
           congestion: str | None = None) -> dict[str, Any]:
    """Make the namespaces and links of `plan`; return how links are shaped.

    With `delay_line` and no netem, a WAN link with a latency runs through its delay
    line's namespace (two veth pairs, the line's process added to `processes`).
    """
    sh("ip", "-batch", "-", stdin="".join(f"netns add {ns}\n" for ns in plan.namespaces))
    delayed = [v for v in plan.veths if v.delay > 0]
    missing = netem_missing(plan.namespaces[0]) if delayed else None
    netem = bool(delayed) and missing is None
    why = ("no link has a latency" if not delayed else missing
           or "netem on links with a latency, tbf on the others")
    through = [(v, v.line_ns) for v in delayed if v.line_ns and delay_line and not netem]
    if through:
        why += ("; WAN links delayed by a delay line (tools/bench/delay_line.py), the other "
                "links' latencies not emulated")
        sh("ip", "-batch", "-", stdin="".join(f"netns add {ns}\n" for _, ns in through))
        plan.namespaces.extend(ns for _, ns in through)
    # the two ends get different ifindexes: the kernel reports the carrier of a veth whose
    # ends share one (each new namespace's first link would) up to a second late
    lined = {v.line_ns for v, _ in through}
    pairs = [((v.a.ns, v.a.dev), (v.b.ns, v.b.dev)) for v in plan.veths
             if v.line_ns not in lined]
    for v, ns in through:
        pairs += [((v.a.ns, v.a.dev), (ns, "a")), ((ns, "b"), (v.b.ns, v.b.dev))]
    sh("ip", "-batch", "-", stdin="".join(
        f"link add name {a_dev} index {100 + 2 * i} netns {a_ns} type veth "
        f"peer name {b_dev} index {101 + 2 * i} netns {b_ns}\n"
        for i, ((a_ns, a_dev), (b_ns, b_dev)) in enumerate(pairs)))
    forward = ("net.ipv4.ip_forward=1",)
    tcp = (*TCP_SYSCTLS, *((f"net.ipv4.tcp_congestion_control={congestion}",)
                           if congestion else ()))
    _parallel([*((_batch, "ip", ns, lines) for ns, lines in plan.ip.items()),
               *((sh, "ip", "netns", "exec", ns, "sysctl", "-qw", *tcp,
                  *(forward if ns in plan.forwarding else ())) for ns in plan.ip),
               *((_batch, "ip", ns, [f"link set dev {dev} mtu {MTU} promisc on up"
                                      for dev in ("a", "b")]) for _, ns in through)])
    tc: dict[str, list[str]] = {}
    for v in plan.veths:
        args = " ".join(qdisc(v.rate, v.delay, netem=netem, queue=SWITCH_QUEUE))
        for end in (v.a, v.b):
            tc.setdefault(end.ns, []).append(f"qdisc add dev {end.dev} root {args}")
    _parallel([(_batch, "tc", ns, lines) for ns, lines in tc.items()])
    _parallel([(_batch, "ip", ns, lines) for ns, lines in plan.up.items() if lines])
    _wait_for_carrier(plan)
    for v, ns in through:
        processes.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m",
             "weightfabric.tools.bench.delay_line", "a", "b", repr(v.delay)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in processes:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise RuntimeError(f"a delay line did not start: {proc.communicate()[1].strip()}")
    used = sh("ip", "netns", "exec", plan.namespaces[0], "sysctl", "-n",
              "net.ipv4.tcp_congestion_control").strip()
    return {"qdisc": "netem" if netem else "tbf", "delay_emulated": netem or bool(through),
            "why": why, "congestion": used}


def _wait_for_carrier(plan: _Plan, timeout: float = 10.0) -> None:
    """Wait until every veth end is up (the kernel reports carrier asynchronously)."""
    ends = {(end.ns, end.dev) for v in plan.veths for end in (v.a, v.b)}
    spaces = sorted({ns for ns, _ in ends})
    deadline = time.monotonic() + timeout
    while True:
        shown = _parallel([(sh, "ip", "-n", ns, "-j", "link", "show") for ns in spaces])
        down = ends - {(ns, i["ifname"]) for ns, out in zip(spaces, shown, strict=True)
                       for i in json.loads(out) if i["operstate"] == "UP"}
        if not down:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"links still down after {timeout:g} s: "
                               f"{', '.join(f'{ns}:{dev}' for ns, dev in sorted(down))}")
        time.sleep(0.05)
