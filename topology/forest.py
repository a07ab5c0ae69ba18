"""The stripe trees of a broadcast: datacenters, then groups of machines, then devices.

`ForestBuilder` places every stripe's tree across datacenters, across the
machines of a datacenter, and hands each machine's inside to
`topology.intranode.StripeTransfers`.

Across datacenters a stripe takes the WAN trees of `topology.wan` (one on a
single-path WAN): it is cut into parts in proportion to the trees' widths, at
multiples of `align` bytes, each part going down its own tree. The tree inside each
datacenter is built once per stripe and recorded (`_Recorder`), with every hop into
another datacenter marked; it is then replayed for each part, down that part's tree,
keeping only the hops into the datacenters that tree has this one feed (routed over
its WAN path). Every part of a stripe lands on the same entry machine of a datacenter
and follows the same tree inside it, each part fed by its own upstream.

Inside a datacenter a stripe goes two levels deep. The machines are *grouped*: by
leaf switch where the leaves are oversubscribed (leaf-aware placement), else the
whole datacenter is one group. Level 1: each group that does not hold the stripe
receives it once, on a *head* machine, from another group; a group's streams to
other groups (and to the entry machines of child datacenters) are its *cross*
quota. Level 2: inside a group, the stripe reaches every member from the roots
(holders, a child datacenter's entry machine) or the head. Both levels are
breadth-first trees whose fan-outs are quotas from `topology.fanout.FanOut`:

- a machine with n NICs sends n streams over all the stripes (one per NIC);
- a group sends, over all the stripes, what its machines have left after serving
  one another: sum of NICs minus, per stripe, its reading machines - 1 (with K
  stripes and K NICs per machine, K streams: one crossing of the spine per stripe
  in, at most K out);
- each stripe takes a contiguous run of those capacities, so every sender relays in
  one or two trees with a large fan-out and none goes over its total unless the
  whole datacenter lacks capacity (then the load spreads one stream at a time).

A machine then receives one stream per NIC (rail-aligned ingress) and sends at most
one per NIC: the NIC egress is balanced exactly, not greedily. The algorithm as a
whole is described in `topology.planner`.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, Literal

from weightfabric.topology.fanout import FanOut
from weightfabric.topology.intranode import StripeTransfers
from weightfabric.topology.layout import Layout
from weightfabric.topology.plan import (
    TREE,
    Interval,
    PlanError,
    Transfer,
    UnreachableReaderError,
    covers,
    intersect,
)
from weightfabric.topology.wan import WanTree

Group = tuple[str, str | None]  # (datacenter, leaf), or (datacenter, "") for all of it

# what a slot feeds: a machine of the group, another group (its head), or the entry
# machine of a child datacenter
MACHINE: Final = "machine"
GROUP: Final = "group"
DATACENTER: Final = "datacenter"
Feed = tuple[Literal["group"], Group] | tuple[Literal["datacenter"], str]  # a cross stream
Child = tuple[Literal["machine"], str] | Feed


@dataclass
class Slot:
    """A sender of one stripe's tree and the streams it has left in it."""

    machine: str
    free: int  # streams it may still send
    egress: int  # the NIC it prefers for the next one (see `ForestBuilder._egress`)
    devices: list[str]  # its devices that hold the stripe


# a recorded hop: (the datacenter it enters or None, source, reader, egress, ingress)
Call = tuple[str | None, str, str, int | None, int | None]


class _Recorder(StripeTransfers):
    """Records the hops of a datacenter's stripe tree (`add`), to replay for each part."""

    def __init__(self, layout: Layout, need: dict[str, list[Interval]],
                 stripes: list[Interval]) -> None:
        super().__init__(layout, need, stripes)
        self.calls: list[Call] = []
        self.into: str | None = None  # the datacenter the hops being added enter

    def add(self, s: int, source: str, reader: str, *, egress: int | None = None,
            ingress: int | None = None, path: tuple[str, ...] | None = None,
            span: Interval | None = None, wan: tuple[str, ...] | None = None) -> None:
        """Record the hop (routes are found on replay)."""
        assert path is None and span is None and wan is None
        self.calls.append((self.into, source, reader, egress, ingress))


class ForestBuilder:
    """Builds the transfers of every stripe tree (see the module docstring)."""

    def __init__(self, layout: Layout, held: dict[str, list[Interval]],
                 need: dict[str, list[Interval]], stripes: list[Interval],
                 planes: list[str], leaf_aware: bool = True, *, wan_paths: int = 4,
                 align: int = 4096) -> None:
        self.layout, self.held, self.need, self.stripes = layout, held, need, stripes
        self.planes = planes
        self.k = len(stripes)
        self.wan_paths, self.align = wan_paths, align
        self.out = StripeTransfers(layout, need, stripes)
        self.shape = _Recorder(layout, need, stripes)
        self.egress_load: dict[str, list[int]] = {}
        self.order = {m: i for i, m in enumerate(layout.machines)}
        self.readers = [[d for d, r in need.items() if intersect(r, lo, hi)]
                        for lo, hi in stripes]
        self.leafwise = {m.datacenter: True for m in layout.machines.values()
                         if leaf_aware and layout.oversubscribed(m.leaf)}
        self.machine_quota: dict[Group, FanOut[str]] = {}
        self.group_quota: dict[str, FanOut[Group]] = {}
        self.cross_demand = 0  # streams between the groups of the datacenter being placed
        self._senders()

    def build(self) -> list[Transfer]:
        """The transfers of every stripe's tree, upstream first."""
        for s, (lo, hi) in enumerate(self.stripes):
            holders = [d for d, r in self.held.items() if covers(r, lo, hi)]
            if not holders:
                raise PlanError(f"bytes [{lo}, {hi}) are held by no source; add a source "
                                "that holds them")
            plane = self.planes[s] if self.planes else TREE
            if plane == TREE or not self.out.side_plane(s, lo, hi, holders, plane):
                self._stripe(s, lo, hi, holders)
        return self.out.transfers

    # one stripe
    def _stripe(self, s: int, lo: int, hi: int, holders: list[str]) -> None:
        lay = self.layout
        readers = self.readers[s]
        if not readers:
            return
        by_machine: dict[str, list[str]] = defaultdict(list)
        for d in readers:
            by_machine[lay.machine_of[d]].append(d)
        holder_machines: dict[str, list[str]] = defaultdict(list)
        for d in holders:
            holder_machines[lay.machine_of[d]].append(d)
        dcs: dict[str, list[str]] = defaultdict(list)
        for m in sorted(by_machine, key=self.order.__getitem__):
            dcs[lay.machines[m].datacenter].append(m)
        roots = {lay.machines[m].datacenter for m in holder_machines}
        trees = lay.wan_trees(roots, set(dcs), most=self.wan_paths)
        for dc in dcs:
            if dc not in roots and dc not in trees[0].parent:
                raise UnreachableReaderError(
                    f"readers in datacenter {dc!r} (e.g. {by_machine[dcs[dc][0]][0]!r}) "
                    f"cannot be reached from any source of bytes [{lo}, {hi}); add a WAN "
                    "link to that datacenter or a source inside it")
        children: dict[str, list[str]] = defaultdict(list)  # over all the trees
        for tree in trees:
            for dc, p in tree.parent.items():
                if dc not in children[p]:
                    children[p].append(dc)
        # each datacenter's tree once, recorded; then replayed for each tree's part
        shapes: dict[str, list[Call]] = {}
        entry_slot: dict[str, list[Slot]] = {}
        queue = deque(sorted(roots))
        while queue:
            dc = queue.popleft()
            if dc in shapes:
                continue
            self.shape.calls = shapes[dc] = []
            self._datacenter(s, dc, dcs.get(dc, []), holder_machines, by_machine,
                             children.get(dc, []), entry_slot)
            queue.extend(children.get(dc, []))
        for tree, span in zip(trees, self._spans(lo, hi, trees), strict=True):
            if span[1] > span[0]:
                self._replay(s, span, tree, roots, shapes)

    def _spans(self, lo: int, hi: int, trees: list[WanTree]) -> list[Interval]:
        """Stripe ``[lo, hi)`` cut in proportion to the trees' widths, at multiples of `align`.

        Parts may be empty (a stripe shorter than the alignment goes whole to one tree).
        """
        total = sum(t.width for t in trees)
        cuts = [lo]
        for acc in accumulate(t.width for t in trees[:-1]):
            at = round((lo + (hi - lo) * acc / total) / self.align) * self.align
            cuts.append(min(hi, max(cuts[-1], at)))
        return list(zip(cuts, cuts[1:] + [hi], strict=True))

    def _replay(self, s: int, span: Interval, tree: WanTree, roots: set[str],
                shapes: dict[str, list[Call]]) -> None:
        """The transfers of part `span` of stripe `s`, datacenter by datacenter down `tree`.

        A datacenter's recorded hops all, but a hop into another datacenter only where
        `tree` has this one feed it (along `tree`'s WAN path).
        """
        children: dict[str, list[str]] = defaultdict(list)
        for dc, p in tree.parent.items():
            children[p].append(dc)
        queue = deque(sorted(roots))
        while queue:
            dc = queue.popleft()
            for into, source, reader, egress, ingress in shapes[dc]:
                if into is None or tree.parent.get(into) == dc:
                    self.out.add(s, source, reader, egress=egress, ingress=ingress, span=span,
                                 wan=tree.path[into] if into is not None else None)
            queue.extend(children.get(dc, []))

    def _datacenter(self, s: int, dc: str, machines: list[str],
                    holder_machines: dict[str, list[str]], by_machine: dict[str, list[str]],
                    exports: list[str], entry_slot: dict[str, list[Slot]]) -> None:
        """Stripe `s` from the holders of datacenter `dc` to its readers, two levels deep.

        Stripe `s` from the holders (or the entry machine) of datacenter `dc` to its reading
        `machines` and to the entry machines of the child datacenters `exports`, two levels
        deep: groups (leaves, or the whole datacenter), then the machines of each group (see
        the module docstring).
        """
        lay = self.layout
        entry: str | None = None  # the machine the parent datacenter feeds
        if dc in entry_slot:
            roots, entry = entry_slot[dc], entry_slot[dc][0].machine
        else:
            roots = [Slot(m, 1, s, devs) for m, devs in
                     sorted(holder_machines.items(), key=lambda kv: self.order[kv[0]])
                     if lay.machines[m].datacenter == dc]
        # readers sharing a machine with a holder (or the entry) are served inside it
        inner = {m for m in machines if m in holder_machines or m == entry}
        for m in machines:
            if m in inner and m != entry:
                self.shape.inside(s, m, by_machine[m], holder_machines[m])
        groups: dict[Group, list[str]] = defaultdict(list)
        for m in machines:
            if m not in inner:
                groups[self._group(m)].append(m)
        rooted: dict[Group, list[Slot]] = defaultdict(list)
        for r in roots:
            rooted[self._group(r.machine)].append(r)
        cross = self._cross(s, dc, groups, rooted, len(exports))
        quota = {g: self._quota(s, g, members, cross.get(g, 0), rooted.get(g))
                 for g, members in groups.items()}
        order, feeds = self._group_tree(groups, rooted, cross, exports)
        heads: dict[Group, str] = {}  # the machine each group gets the stripe on
        for g in order:
            members, q = groups.get(g, []), quota.get(g, {})
            head = heads.get(g)
            starts = (rooted[g] if head is None
                      else [Slot(head, q.get(head, 0), s, by_machine[head])])
            slots = deque(x for x in starts if x.free > 0)
            relays = sorted((m for m in members if m != head and q.get(m)), key=lambda m: -q[m])
            children: list[Child] = [(MACHINE, m) for m in relays] + feeds.get(g, []) \
                + [(MACHINE, m) for m in members if m != head and not q.get(m)]
            for child in children:
                if not slots:  # over capacity: the group's first senders send once more
                    slots.extend(Slot(x.machine, 1, x.egress, x.devices) for x in starts)
                sender, egress = self._next(slots, s)
                if child[0] == GROUP:  # the group's relay with the largest quota receives it
                    fed = child[1]
                    target = heads[fed] = max(groups[fed], key=lambda m: quota[fed].get(m, 0))
                elif child[0] == DATACENTER:
                    target = self._entry(child[1], by_machine)
                else:
                    target = child[1]
                self.shape.into = child[1] if child[0] == DATACENTER else None
                self._land(s, sender, target, by_machine[target], egress)
                self.shape.into = None
                if child[0] == DATACENTER:
                    entry_slot[child[1]] = [Slot(target, 1, s, by_machine[target])]
                elif child[0] == MACHINE and q.get(target):
                    slots.append(Slot(target, q[target], s, by_machine[target]))

    def _next(self, slots: deque[Slot], s: int) -> tuple[str, int]:
        """Use a slot of the first sender in `slots`: (sending device, egress NIC)."""
        slot = slots[0]
        egress = self._egress(slot.machine, slot.egress)
        slot.free -= 1
        slot.egress += 1
        if slot.free == 0:
            slots.popleft()
        return self._sender(slot.machine, egress, slot.devices, s), egress

    def _group(self, machine: str) -> Group:
        """The group `machine` is placed in.

        Its leaf where the datacenter's leaves are oversubscribed (and placement is
        leaf-aware), else the whole datacenter.
        """
        m = self.layout.machines[machine]
        return (m.datacenter, m.leaf) if self.leafwise.get(m.datacenter) else (m.datacenter, "")

    def _senders(self) -> None:
        """The fan-out quotas: per group, its reading machines (a NIC stream each).

        Per datacenter, its groups, each with the streams its machines have left after
        serving one another (sum of NICs minus, per stripe, its reading machines - 1).
        """
        lay = self.layout
        members: dict[Group, set[str]] = defaultdict(set)
        served: dict[Group, int] = defaultdict(int)
        for readers in self.readers:
            per: dict[Group, set[str]] = defaultdict(set)
            for d in readers:
                m = lay.machine_of[d]
                per[self._group(m)].add(m)
            for g, ms in per.items():
                served[g] += len(ms) - 1
                members[g] |= ms
        spare: dict[str, dict[Group, int]] = defaultdict(dict)
        for g, ms in members.items():
            names = sorted(ms, key=self.order.__getitem__)
            nics = {m: max(1, len(lay.machines[m].nics)) for m in names}
            self.machine_quota[g] = FanOut(names, nics)
            spare[g[0]][g] = sum(nics.values()) - served[g]
        for dc, caps in spare.items():
            groups = sorted(caps, key=lambda g: self.order[self.machine_quota[g].names[0]])
            self.group_quota[dc] = FanOut(groups, caps)

    def _cross(self, s: int, dc: str, groups: dict[Group, list[str]],
               rooted: dict[Group, list[Slot]], exports: int) -> dict[Group, int]:
        """Streams each group sends to other groups and child datacenters.

        One per root slot from the groups holding the stripe, the rest by the datacenter's
        quotas over the others (the holding groups only when those run out).
        """
        free = [g for g in groups if g not in rooted]
        demand = self.cross_demand = len(free) + exports
        quota = self.group_quota.setdefault(dc, FanOut([], {}))
        cross: dict[Group, int] = {}
        for g, slots in rooted.items():
            c = min(demand, sum(x.free for x in slots))
            cross[g] = c
            demand -= c
            if groups.get(g):  # its members serve every member but what the roots send
                quota.charge(g, c - sum(x.free for x in slots) + 1)
        slack = quota.total(free) - demand * (self.k - s)
        for g, c in quota.take(demand, free, spill=list(rooted), slack=slack).items():
            cross[g] = cross.get(g, 0) + c
            if g in rooted:
                quota.charge(g, c)
        return cross

    def _quota(self, s: int, g: Group, members: list[str], cross: int,
               roots: list[Slot] | None) -> dict[str, int]:
        """Streams each machine of group `g` sends in this stripe.

        One to every other member and `cross` out of the group, less what the roots (or the
        head) send. Slack for `FanOut.take`: what the members have beyond this stripe's
        need, the later stripes' (as many members) and the cross streams the group may still
        owe.
        """
        demand = len(members) + cross - (sum(x.free for x in roots) if roots else 1)
        if demand <= 0:
            return {}
        quota, later = self.machine_quota[g], self.k - 1 - s
        owed = min(max(0, self.group_quota[g[0]].left.get(g, 0)), later * self.cross_demand)
        slack = quota.total(members) - demand - later * (len(members) - 1) - owed
        return quota.take(demand, members, slack=slack)

    @staticmethod
    def _group_tree(groups: dict[Group, list[str]], rooted: dict[Group, list[Slot]],
                    cross: dict[Group, int], exports: list[str]
                    ) -> tuple[list[Group], dict[Group, list[Feed]]]:
        """Breadth first over the groups.

        The order to fill them in, and what each group's cross streams feed (other groups,
        then child datacenters).
        """
        free = [g for g in groups if g not in rooted]
        relays = sorted((g for g in free if cross.get(g)), key=lambda g: -cross[g])
        children: list[Feed] = [(GROUP, g) for g in relays] \
            + [(DATACENTER, d) for d in exports] + [(GROUP, g) for g in free if not cross.get(g)]
        slots = deque((g, cross[g]) for g in rooted if cross.get(g))  # (group, streams left)
        feeds: dict[Group, list[Feed]] = defaultdict(list)
        for child in children:
            if not slots:  # unreachable while the quotas add up; stay valid anyway
                slots.append((next(iter(rooted)), 1))
            sender, left = slots[0]
            feeds[sender].append(child)
            left -= 1
            if left == 0:
                slots.popleft()
            else:
                slots[0] = (sender, left)
            if child[0] == GROUP and cross.get(child[1]):
                slots.append((child[1], cross[child[1]]))
        return list(rooted) + [c[1] for c in children if c[0] == GROUP], feeds

    def _egress(self, machine: str, preferred: int) -> int:
        """The least used NIC of `machine` so far (ties: from `preferred` on)."""
        n = max(1, len(self.layout.machines[machine].nics))
        load = self.egress_load.setdefault(machine, [0] * n)
        rail = min(range(n), key=lambda r: (load[r], (r - preferred) % n))
        load[rail] += 1
        return rail

    def _entry(self, dc: str, by_machine: dict[str, list[str]]) -> str:
        lay = self.layout
        return min((m for m in by_machine if lay.machines[m].datacenter == dc),
                   key=self.order.__getitem__)

    def _sender(self, machine: str, egress: int, devices: list[str], s: int) -> str:
        m = self.layout.machines[machine]
        if m.nics:
            rail = m.rail_gpu.get(egress % len(m.nics))
            if rail in devices:
                return rail
        return devices[egress % len(devices)]

    def _land(self, s: int, sender: str, machine: str, devices: list[str], egress: int) -> str:
        """Transfer stripe `s` from `sender` into `machine`, then fan it out inside."""
        m = self.layout.machines[machine]
        ingress = s % len(m.nics) if m.nics else 0
        rail = m.rail_gpu.get(ingress) if m.nics else None
        landing = rail if rail in devices else devices[s % len(devices)]
        self.shape.add(s, sender, landing, egress=egress, ingress=ingress)
        self.shape.fan_out(s, m, landing, [d for d in devices if d != landing])
        return landing


__all__ = ["ForestBuilder"]
