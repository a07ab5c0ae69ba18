"""A hub's part in a service of several hubs on one etcd: records, campaign, lead, step down.

Every hub of the service is a candidate in one etcd election (`fabric.hub.election`)
whose value is the hub's URL: the candidate keys are also the list of hubs, oldest
(the leader) first. A daemon thread campaigns; the hub's loop asks `is_leader` at
every tick and changes role on its own thread (loads the records when it wins, drops
its state when it loses). A leader steps down as soon as it cannot keep its etcd
lease alive (two thirds of the lease into a silence), before etcd can have let
another hub win, and its writes are guarded by its election key in any case.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from weightfabric.fabric.hub.election import Election
from weightfabric.fabric.hub.etcd import Compare, EtcdClient, EtcdError
from weightfabric.fabric.hub.etcd_records import EtcdRecords

log = logging.getLogger(__name__)

DEFAULT_ELECTION_TTL_S = 2.0
"""The leader's etcd lease: a leader whose machine is gone is replaced about this long
after (plus a campaign poll)."""
VIEW_EVERY_S = 1.0


class HubService:
    """The records in etcd at ``store`` and, once started (`start`), the campaign for the lead.

    Args:
        store: ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (prefix ``/weightfabric``).
        ttl: the election lease in seconds (`DEFAULT_ELECTION_TTL_S`).
        etcd_timeout: seconds each etcd call may take.

    Raises:
        ValueError: a bad URL, or a key space some other program wrote.
        StoreUnavailableError: etcd does not answer (checked here: a hub never starts
            half-configured).
    """

    def __init__(self, store: str, *, ttl: float = DEFAULT_ELECTION_TTL_S,
                 etcd_timeout: float = 2.0) -> None:
        self.client, prefix = EtcdClient.from_url(store, timeout=etcd_timeout)
        self.records = EtcdRecords(self.client, prefix, guard=self.guard)
        try:
            self.records.load()
        except BaseException:
            self.client.close()
            raise
        self.prefix = f"{self.records.prefix}/leader"
        self.url = ""
        self.ttl = ttl
        self.terms = 0
        """Terms this hub has led (each win counts)."""
        self.view: dict[str, Any] = {"leader": None, "hubs": [], "etcd": []}
        """The service as etcd last showed it (refreshed every `VIEW_EVERY_S` on a thread of
        its own, so that `fabric hub status` never waits for a silent etcd member)."""
        self._election: Election | None = None
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, url: str) -> HubService:
        """Campaign for ``url`` (this hub's, as clients reach it) on daemon threads."""
        self.url = url
        for target, name in ((self._campaign_loop, "fabric-hub-election"),
                             (self._watch_loop, "fabric-hub-service")):
            t = threading.Thread(target=target, daemon=True, name=name)
            t.start()
            self._threads.append(t)
        return self

    def step_down(self) -> None:
        """Give up the lead now (the records could not be saved); campaign again."""
        e = self._election
        if e is not None:
            try:
                e.resign()
            except EtcdError as exc:
                log.warning("resigning from the hub election failed (its lease runs out "
                            "instead): %s", exc)

    @property
    def is_leader(self) -> bool:
        """Whether this hub leads now (won, and its lease is still fresh)."""
        e = self._election
        return e is not None and e.is_leader

    def guard(self) -> Compare:
        """The compare under which this hub's writes apply (`Election.guard`).

        Raises:
            RuntimeError: this hub does not lead.
        """
        e = self._election
        if e is None or not e.is_leader:
            raise RuntimeError("guard() of a hub that does not lead")
        return e.guard()

    def hubs(self) -> list[str]:
        """Every hub campaigning, the leader first (etcd's view; empty when it is silent)."""
        try:
            kvs = self.client.get_prefix(self.prefix + "/")
        except EtcdError:
            return []
        return [kv.value.decode() for kv in sorted(kvs, key=lambda kv: kv.create_revision)]

    def etcd_members(self) -> list[dict[str, Any]]:
        """The etcd members and each one's health, as `fabric hub status` shows them."""
        try:
            members = self.client.members()
        except EtcdError as exc:
            return [{"name": "?", "endpoint": ep, "healthy": False, "error": str(exc)}
                    for ep in self.client.endpoints]
        out = []
        for m in members:
            ep = m.client_urls[0] if m.client_urls else ""
            st = self.client.status(ep) if ep else {"healthy": False, "error": "no client URL"}
            out.append({"name": m.name, "endpoint": ep, "healthy": bool(st.get("healthy")),
                        "leader": bool(st.get("healthy")) and st.get("leader") == m.id,
                        "error": st.get("error")})
        return out

    def stop(self) -> None:
        """Stop campaigning, resign (another hub takes over at once) and close etcd."""
        self._stop.set()
        self.step_down()
        for t in self._threads:
            t.join(self.ttl + 2)
        self.client.close()

    def status(self) -> dict[str, Any]:
        """This hub's role and the service as `fabric hub status` shows it."""
        return {"role": "leader" if self.is_leader else "standby", "url": self.url,
                "terms": self.terms, "store": self.records.describe, **self.view}

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            hubs = self.hubs()
            self.view = {"leader": hubs[0] if hubs else None, "hubs": hubs,
                         "etcd": self.etcd_members()}
            self._stop.wait(VIEW_EVERY_S)

    def _campaign_loop(self) -> None:
        while not self._stop.is_set():
            self._lost.clear()
            election = Election(self.client, self.prefix, self.url.encode(), ttl=self.ttl,
                                on_lost=self._lost.set)
            try:
                self._election = election
                if not election.campaign(stop=self._stop):
                    continue
            except EtcdError as exc:
                log.warning("hub election: etcd does not answer (%s); trying again", exc)
                self._election = None
                self._stop.wait(min(1.0, self.ttl / 2))
                continue
            self.terms += 1
            log.info("hub %s leads (term %d)", self.url, self.terms)
            while not self._stop.is_set() and election.is_leader:
                self._lost.wait(0.05)
            if self._stop.is_set():
                return
            log.warning("hub %s lost the lead; campaigning again", self.url)
            self.step_down()


__all__ = ["DEFAULT_ELECTION_TTL_S", "VIEW_EVERY_S", "HubService"]
