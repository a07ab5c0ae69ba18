"""The stripe trees of a broadcast: datacenters, then machines (leaf-aware), then devices.

`ForestBuilder` places every stripe's tree across datacenters (a widest-path
tree over the WAN gateways), across the machines of a datacenter (SplitStream /
rail-aligned, or leaf by leaf under oversubscribed leaves) and hands each
machine's inside to `topology.intranode.StripeTransfers`. The algorithm is
described in `topology.planner`.
"""

from __future__ import annotations

from collections import defaultdict, deque

from topology.intranode import StripeTransfers
from topology.layout import Layout
from topology.plan import (
    TREE,
    Interval,
    PlanError,
    Transfer,
    UnreachableReaderError,
    covers,
    intersect,
)


class ForestBuilder:
    """Builds the transfers of every stripe tree (see the module docstring)."""

    def __init__(self, layout: Layout, held: dict[str, list[Interval]],
                 need: dict[str, list[Interval]], stripes: list[Interval],
                 planes: list[str], leaf_aware: bool = True) -> None:
        self.layout, self.held, self.need, self.stripes = layout, held, need, stripes
        self.planes, self.leaf_aware = planes, leaf_aware
        self.k = len(stripes)
        self.out = StripeTransfers(layout, need, stripes)
        self.egress_load: dict[str, list[int]] = {}
        self.home: dict[str, int] = {}  # the tree a machine is interior in
        self.leaf_budget: dict[str | None, int] = {}  # cross-leaf streams a leaf may send
        order = {m: i for i, m in enumerate(layout.machines)}
        self.order = order

    def build(self) -> list[Transfer]:
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
        readers = [d for d, r in self.need.items() if intersect(r, lo, hi)]
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
        parents = lay.wan_tree(roots, set(dcs))
        for dc in dcs:
            if dc not in roots and dc not in parents:
                raise UnreachableReaderError(
                    f"readers in datacenter {dc!r} (e.g. {by_machine[dcs[dc][0]][0]!r}) "
                    f"cannot be reached from any source of bytes [{lo}, {hi}); add a WAN "
                    "link to that datacenter or a source inside it")
        children: dict[str, list[str]] = defaultdict(list)
        for dc, p in parents.items():
            children[p].append(dc)
        entry_slot: dict[str, list[list]] = {}
        queue = deque(sorted(roots))
        while queue:
            dc = queue.popleft()
            self._datacenter(s, dc, dcs.get(dc, []), holder_machines, by_machine,
                             children.get(dc, []), entry_slot)
            queue.extend(children.get(dc, []))

    def _datacenter(self, s: int, dc: str, machines: list[str],
                    holder_machines: dict[str, list[str]], by_machine: dict[str, list[str]],
                    exports: list[str], entry_slot: dict[str, list[list]]) -> None:
        lay = self.layout
        slots: deque[list] = deque()  # [machine, free slots, next egress, devices holding]
        if dc in entry_slot:
            slots.extend(entry_slot[dc])
            entry = entry_slot[dc][0][0]
        else:
            entry = None
            for m, devs in sorted(holder_machines.items(), key=lambda kv: self.order[kv[0]]):
                if lay.machines[m].datacenter == dc:
                    slots.append([m, 1, s, devs])
        # readers sharing a machine with a holder (or the entry) are served inside it
        inner = [m for m in machines if m in holder_machines or m == entry]
        for m in inner:
            if m != entry:
                self.out.inside(s, m, by_machine[m], holder_machines[m])
        rest = [m for m in machines if m not in inner]
        if self.leaf_aware and any(lay.oversubscribed(lay.machines[m].leaf) for m in rest):
            self._by_leaf(s, rest, slots, exports, by_machine, entry_slot)
            return
        for i, m in enumerate(rest):
            self.home.setdefault(m, i % self.k)
        designated = [m for i, m in enumerate(rest) if i % self.k == s % self.k]
        others = [m for m in rest if m not in set(designated)]
        if others:
            shift = (s * max(1, len(others) // self.k)) % len(others)
            others = others[shift:] + others[:shift]
        spare: deque[str] = deque()
        order = [(m, True) for m in designated] + [(dc2, None) for dc2 in exports] \
            + [(m, False) for m in others]
        roots = list(slots)
        for item, interior in order:
            if not slots:
                if spare:  # promote the leaf with the most unused NIC egress
                    m = min(spare, key=lambda x: self._committed(x, s))
                    spare.remove(m)
                    slots.append([m, self.k, s, by_machine[m]])
                else:  # overload the roots rather than fail
                    slots.extend([r[0], 1, r[2], r[3]] for r in roots)
            slot = slots[0]
            parent, senders = slot[0], slot[3]
            egress = self._egress(parent, slot[2])
            slot[1] -= 1
            slot[2] += 1
            if slot[1] == 0:
                slots.popleft()
            sender = self._sender(parent, egress, senders, s)
            if interior is None:  # a child datacenter: its entry machine
                target = self._entry(item, by_machine)
                self._land(s, sender, target, by_machine[target], egress)
                entry_slot[item] = [[target, 1, s, by_machine[target]]]
                continue
            self._land(s, sender, item, by_machine[item], egress)
            if interior:
                slots.append([item, self.k, s, by_machine[item]])
            else:
                spare.append(item)

    def _by_leaf(self, s: int, rest: list[str], slots: deque[list], exports: list[str],
                 by_machine: dict[str, list[str]], entry_slot: dict[str, list[list]]) -> None:
        """Stripe `s` into the machines `rest` of an oversubscribed datacenter.

        The SplitStream construction one level up. Each leaf receives the stripe
        once over the spine, on an *entry* machine, and fans it out under the leaf
        (a breadth-first tree of fan-out K, rotated with the stripe so that every
        machine relays about once); a leaf under a holder reads the holder's stream
        without crossing the spine. Relaying under a leaf of L machines costs
        (L-1)·K of the leaf's K·L NIC streams, so each leaf has a budget of K
        cross-leaf streams over all trees. The leaf-level trees are built breadth
        first: when no slot is left, the leaf that has the stripe and the most
        budget left gets min(K, budget) slots, spread over its machines by NIC
        egress committed. A leaf's uplink then carries each stripe in at most once
        and at most about K streams out (S in, S out: the least possible without a
        holder under it), and every machine sends about K streams, one per NIC.
        """
        lay = self.layout
        groups: dict[str | None, list[str]] = defaultdict(list)
        for m in rest:
            groups[lay.machines[m].leaf].append(m)
        for leaf in groups:
            self.leaf_budget.setdefault(leaf, self.k)
        rooted = [lf for lf in groups if any(lay.machines[r[0]].leaf == lf for r in slots)]
        free = [lf for lf in groups if lf not in rooted]
        if free:
            shift = (s * max(1, len(free) // self.k)) % len(free)
            free = free[shift:] + free[:shift]
        roots, have = list(slots), []
        for leaf in rooted + free:
            members = self._leaf_order(groups[leaf], s)
            parent, egress, senders = self._cross(s, slots, roots, have, rooted, groups,
                                                  by_machine, leaf)
            head = members[0]
            self._land(s, self._sender(parent, egress, senders, s), head, by_machine[head],
                       egress)
            local: deque[list] = deque([[head, self.k, s, by_machine[head]]])
            for m in members[1:]:  # breadth first under the leaf, fan-out K
                parent, egress, senders = self._use(local, leaf)
                self._land(s, self._sender(parent, egress, senders, s), m, by_machine[m],
                           egress)
                local.append([m, self.k, s, by_machine[m]])
            have.append(leaf)
        for dc in exports:
            parent, egress, senders = self._cross(s, slots, roots, have, rooted, groups,
                                                  by_machine, None)
            target = self._entry(dc, by_machine)
            self._land(s, self._sender(parent, egress, senders, s), target, by_machine[target],
                       egress)
            entry_slot[dc] = [[target, 1, s, by_machine[target]]]

    def _cross(self, s: int, slots: deque[list], roots: list[list], have: list,
               rooted: list, groups: dict[str | None, list[str]], by_machine: dict[str, list[str]],
               leaf: str | None) -> tuple[str, int, list[str]]:
        """A slot to send stripe `s` into `leaf` (see `_by_leaf`); one under `leaf`
        first, else promote the leaf in `have` with the most budget, else overload
        the roots."""
        lay = self.layout
        if not any(lay.machines[x[0]].leaf == leaf for x in slots) and not slots:
            if have:
                best = max(have, key=lambda lf: (self.leaf_budget[lf], -have.index(lf)))
                have.remove(best)
                # a leaf under a holder is the only one with the stripe at first in every
                # tree: keep one stream of its budget for each later tree
                reserve = self.k - 1 - s if best in rooted else 0
                grant = min(self.k, max(1, self.leaf_budget[best] - reserve))
                slots.extend(self._leaf_slots(groups[best], s, by_machine, grant))
            else:
                slots.extend([r[0], 1, r[2], r[3]] for r in roots)
        parent, egress, senders = self._use(slots, leaf)
        source_leaf = lay.machines[parent].leaf
        if source_leaf != leaf and source_leaf in self.leaf_budget:
            self.leaf_budget[source_leaf] -= 1
        return parent, egress, senders

    def _use(self, slots: deque[list], leaf: str | None) -> tuple[str, int, list[str]]:
        """Use one slot, preferring one under `leaf`: (parent, egress NIC, devices)."""
        lay = self.layout
        slot = next((x for x in slots if lay.machines[x[0]].leaf == leaf), slots[0])
        egress = self._egress(slot[0], slot[2])
        slot[1] -= 1
        slot[2] += 1
        if slot[1] == 0:
            slots.remove(slot)
        return slot[0], egress, slot[3]

    def _leaf_order(self, members: list[str], s: int) -> list[str]:
        """`members` rotated for stripe `s` so that the relays under a leaf change
        from tree to tree (the first is the entry)."""
        shift = (s * max(1, len(members) // self.k)) % len(members)
        return members[shift:] + members[:shift]

    def _leaf_slots(self, members: list[str], s: int, by_machine: dict[str, list[str]],
                    count: int) -> list[list]:
        """`count` one-stream slots over `members`, least NIC egress committed first
        (used so far, plus what it will relay under the leaf in later trees)."""
        load = {m: sum(self.egress_load.get(m, ())) for m in members}
        for later in range(s + 1, self.k):
            left = len(members) - 1
            for m in self._leaf_order(members, later):  # breadth first, fan-out K
                load[m] += min(self.k, left)
                left -= min(self.k, left)
                if not left:
                    break
        out = []
        for _ in range(count):
            m = min(members, key=load.__getitem__)
            load[m] += 1
            out.append([m, 1, s, by_machine[m]])
        return out

    def _committed(self, machine: str, s: int) -> int:
        """NIC streams `machine` sends: used so far, plus K if it is still to be
        interior in a later tree."""
        later = self.home.get(machine, -1) > s
        return sum(self.egress_load.get(machine, ())) + (self.k if later else 0)

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
        self.out.add(s, sender, landing, egress=egress, ingress=ingress)
        self.out.fan_out(s, m, landing, [d for d in devices if d != landing])
        return landing


__all__ = ["ForestBuilder"]
