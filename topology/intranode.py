"""The transfers of a broadcast forest as they are added, and the hops inside one machine.

`StripeTransfers.add` appends a stripe's transfer from a source to a reader (each
one fed by the transfer that brought the stripe, or the part of it that takes one
WAN tree, to its source); `inside` and
`fan_out` forward a stripe from the device it landed on to a machine's other
readers (one hop over NVSwitch, else a chain over NVLink / PCIe pairs), and
`side_plane` sends a stripe over the host or NIC-loopback plane of one machine.
"""

from __future__ import annotations

from weightfabric.topology.layout import Layout, Machine, dedupe
from weightfabric.topology.plan import (
    HOST,
    Interval,
    Transfer,
    UnreachableReaderError,
    covers,
    intersect,
)


class StripeTransfers:
    """The transfers added so far, upstream first.

    Args:
        layout: the indexed cluster.
        need: per reader, the byte ranges it needs.
        stripes: the stripes' byte ranges.
    """

    def __init__(self, layout: Layout, need: dict[str, list[Interval]],
                 stripes: list[Interval]) -> None:
        self.layout, self.need, self.stripes = layout, need, stripes
        self.transfers: list[Transfer] = []
        # (device, stripe, start of the part) -> the transfer that feeds it
        self.incoming: dict[tuple[str, int, int], int] = {}

    def side_plane(self, s: int, lo: int, hi: int, holders: list[str], plane: str) -> bool:
        """Stripe `s` over the host or the NIC loopback of one machine.

        False (and nothing added) when that plane does not fit these holders and readers.
        """
        lay = self.layout
        readers = [d for d, r in self.need.items() if intersect(r, lo, hi)]
        if not readers:
            return True
        m = lay.machine(readers[0])
        local = [h for h in holders if lay.machine_of[h] == m.name]
        if any(lay.machine_of[r] != m.name for r in readers) or not local:
            return False
        # a chain (each link carries the stripe once); relays need all of it to forward
        if any(not covers(self.need[r], lo, hi) for r in readers):
            return False
        if plane == HOST:  # PCIe peer-to-peer through the root complex
            src = next((h for h in local if len(lay.to_host(h)) > 1), None)
            if src is None or m.host in readers:
                return False
        else:  # NIC_LOOP: GPUDirect RDMA out of one rail NIC, back in through the next
            src = next((h for h in local if lay.rail_nic(h)), None)
            if src is None or m.leaf is None or not all(lay.rail_nic(r) for r in readers):
                return False
        prev = src
        for r in sorted(readers, key=lay.rail_of):
            self.add(s, prev, r, path=self._plane_path(plane, m, prev, r))
            prev = r
        return True

    def _plane_path(self, plane: str, m: Machine, a: str, b: str) -> tuple[str, ...]:
        """`a` -> `b` on one machine.

        Up one PCIe port and down the other (`HOST`), or out of `a`'s rail NIC, through the
        leaf and in through `b`'s (`NIC_LOOP`).
        """
        lay = self.layout
        if plane == HOST:
            return dedupe(lay.to_host(a) + tuple(reversed(lay.to_host(b))))
        nic_a, nic_b = lay.rail_nic(a), lay.rail_nic(b)
        # side_plane only loops through the NICs of rail devices on a leaf
        assert nic_a is not None and nic_b is not None and m.leaf is not None
        return (lay.to_nic(m, a, nic_a) + (m.leaf,)
                + tuple(reversed(lay.to_nic(m, b, nic_b))))

    def inside(self, s: int, machine: str, devices: list[str], holders: list[str]) -> None:
        """Give stripe `s` from `holders` to `devices` inside `machine`."""
        m = self.layout.machines[machine]
        if not self.switched(m, devices + holders):  # one chain along NVLink/PCIe
            order = self.chain(holders[0], devices)
            self.add(s, holders[0], order[0])
            self.fan_out(s, m, order[0], order[1:])
            return
        landing = devices[s % len(devices)]
        rail = self.layout.rail_of(landing)
        source = next((h for h in holders if self.layout.rail_of(h) == rail), holders[0])
        self.add(s, source, landing)
        self.fan_out(s, m, landing, [d for d in devices if d != landing])

    @staticmethod
    def switched(m: Machine, devices: list[str]) -> bool:
        """Whether `devices` are GPUs of `m` joined by its NVSwitch."""
        return m.nvswitch is not None and all(d in m.gpus for d in devices)

    def chain(self, start: str, devices: list[str]) -> list[str]:
        """`devices` ordered greedily so that consecutive ones share a direct link."""
        g, left, order, cur = self.layout.graph, list(devices), [], start
        while left:
            nxt = next((d for d in left if g.has_edge(cur, d)), left[0])
            left.remove(nxt)
            order.append(nxt)
            cur = nxt
        return order

    def fan_out(self, s: int, m: Machine, landing: str, others: list[str]) -> None:
        """Forward stripe `s` from `landing` to `others` on machine `m`."""
        if not others:
            return
        if self.switched(m, others + [landing]):
            for d in others:
                self.add(s, landing, d)
            return
        prev = landing
        for d in self.chain(landing, others):
            self.add(s, prev, d)
            prev = d

    def add(self, s: int, source: str, reader: str, *, egress: int | None = None,
            ingress: int | None = None, path: tuple[str, ...] | None = None,
            span: Interval | None = None, wan: tuple[str, ...] | None = None) -> None:
        """Add the transfers of stripe `s` from `source` that `reader` needs.

        Of the stripe's part `span` (default all of it), fed by the transfer that brought
        that part to `source`; `wan` fixes the WAN gateways of the route (see `Layout.route`).
        """
        lo, hi = span if span is not None else self.stripes[s]
        if path is None:
            path = self.layout.route(source, reader, egress=egress, ingress=ingress, wan=wan)
        if path is None:
            raise UnreachableReaderError(
                f"reader {reader!r} has no route from {source!r} (no NIC, leaf or WAN link "
                "joins their machines); give its machine a NIC or add a source next to it")
        up = self.incoming.get((source, s, lo))
        depth = self.transfers[up].depth + 1 if up is not None else 1
        first = None
        for a, b in intersect(self.need[reader], lo, hi):
            self.transfers.append(Transfer(reader=reader, source=source, start=a, end=b,
                                           stripe=s, path=path, upstream=up, depth=depth))
            first = len(self.transfers) - 1 if first is None else first
        if first is not None:
            self.incoming[(reader, s, lo)] = len(self.transfers) - 1


__all__ = ["StripeTransfers"]
