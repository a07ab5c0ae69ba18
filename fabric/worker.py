"""`Worker`: one process taking part in the fabric with data.

A worker is a registered hub client plus the data plane: a `ReadServer` that
serves its exposed replicas, shared-memory and TCP transports to read from
peers, and the arena regions its model stores allocate. Create one with
`fabric.join`; get a model's store with `Worker.model`.
"""

from __future__ import annotations

import logging
import threading

from fabric.arena import remove_stale_regions
from fabric.client import HubClient
from fabric.locality import Location
from fabric.store import ModelStore
from fabric.tensorset import DEFAULT_CHUNK_SIZE
from fabric.transports import (
    ReadServer,
    ShmTransport,
    SourceAddress,
    TcpTransport,
    Transport,
    choose_transport,
)

log = logging.getLogger(__name__)


class Worker:
    """A process that publishes and/or fetches versions. See `fabric.join`."""

    def __init__(self, url: str, *, worker: str,
                 location: Location | dict[str, str] | None = None, host: str = "127.0.0.1",
                 timeout: float = 10.0, heartbeat: bool = True) -> None:
        removed = remove_stale_regions()
        if removed:
            log.info("removed %d arena files of dead workers", len(removed))
        self.server = ReadServer(host=host)
        try:
            self.hub = HubClient(url, worker=worker, location=location,
                                 endpoints={"read": self.server.address.to_dict()},
                                 timeout=timeout, heartbeat=heartbeat).open()
        except BaseException:
            self.server.close()
            raise
        self.name = worker
        self.location = self.hub.location
        self._shm = ShmTransport()
        self._tcp = TcpTransport()
        self._stores: dict[str, ModelStore] = {}
        self._lock = threading.Lock()
        self._closed = False

    def model(self, name: str, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ModelStore:
        """The store of model `name` (created once per worker)."""
        with self._lock:
            store = self._stores.get(name)
            if store is None:
                store = self._stores[name] = ModelStore(self, name, chunk_size=chunk_size)
            elif store.chunk_size != chunk_size:
                raise ValueError(f"model {name!r} is already open with chunk_size "
                                 f"{store.chunk_size}, not {chunk_size}")
            return store

    def transport_for(self, address: SourceAddress) -> Transport:
        """Shared memory for sources on this host, TCP otherwise."""
        return choose_transport(address, shm=self._shm, tcp=self._tcp)

    @property
    def bytes_served(self) -> int:
        """Bytes this worker has served to readers (its egress)."""
        return self.server.bytes_served

    def close(self) -> None:
        """Leave the fabric: stop serving, unregister, free arena memory."""
        if self._closed:
            return
        self._closed = True
        try:  # first, so the hub stops routing readers here
            self.hub.unregister()
        except Exception as exc:  # the hub may be gone; our lease then simply runs out
            log.warning("worker %s could not unregister: %s", self.name, exc)
        for store in list(self._stores.values()):
            store.close()  # waits for reads already in flight
        self.hub.close()
        self.server.close()
        self._shm.close()
        self._tcp.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def join(url: str, *, worker: str, location: Location | dict[str, str] | None = None,
         host: str = "127.0.0.1", timeout: float = 10.0) -> Worker:
    """Join the fabric at hub `url` as `worker`, ready to publish and fetch.

    Args:
        url: the hub, e.g. ``tcp://10.0.0.1:7470`` (see `fabric hub serve`).
        worker: a unique id, e.g. ``"rollout-3"``.
        location: ``{"datacenter", "node", "device"}`` used to rank sources.
        host: the address this worker's read server listens on (peers on other
            hosts must reach it).
        timeout: per hub call.

    Raises:
        HubUnavailableError: no hub answers at `url`.
        DuplicateWorkerError: another live worker uses this id.

    Example:
        >>> worker = fabric.join(url, worker="rollout-3")    # doctest: +SKIP
        >>> store = worker.model("policy")                   # doctest: +SKIP
        >>> store.attach(model); store.fetch("latest")       # doctest: +SKIP
    """
    return Worker(url, worker=worker, location=location, host=host, timeout=timeout)
