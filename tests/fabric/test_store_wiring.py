"""How a store is wired.

No import path from `fabric.store` to `fabric.worker`, a store built from its collaborators
alone, and the transport selector's descriptor cache.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hub_helpers import reader_address

import weightfabric as wf
from weightfabric.fabric.errors import BadRequestError
from weightfabric.fabric.fetch import Source
from weightfabric.fabric.store import ModelStore
from weightfabric.fabric.transports import ReadServer
from weightfabric.fabric.transports import selector as selector_module
from weightfabric.fabric.transports.selector import TransportSelector

ROOT = Path(wf.__file__).resolve().parent


def module_file(name: str) -> Path | None:
    """The file of module ``weightfabric.X.Y`` in this checkout, if it is one of ours."""
    parts = name.split(".")[1:]
    base = ROOT.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imports(name: str, *, typing: bool) -> set[str]:
    """The weightfabric modules ``name`` imports, with their parent packages.

    The weightfabric modules ``name`` imports (lazy imports in functions too; those under
    ``if TYPE_CHECKING:`` only with ``typing``), with their parent packages but the root
    (whose ``__init__`` is the public API and imports everything).
    """
    path = module_file(name)
    assert path is not None, name
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if (not typing and isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test)):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    ours: set[str] = set()
    for mod in found:
        if not mod.startswith("weightfabric.") or module_file(mod) is None:
            continue
        parts = mod.split(".")
        ours.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return ours


def reachable(start: str, *, typing: bool = False) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(imports(mod, typing=typing) - seen)
    return seen


@pytest.mark.parametrize("typing", [False, True], ids=["runtime", "with-type-imports"])
def test_the_store_does_not_import_the_worker(typing):
    """Not even for type hints: the store knows its collaborators, not its worker."""
    graph = reachable("weightfabric.fabric.store", typing=typing)
    assert "weightfabric.fabric.buffer_pool" in graph  # the walk sees the store's imports
    assert "weightfabric.fabric.transports.selector" in graph
    assert "weightfabric.fabric.worker" not in graph
    assert "weightfabric.fabric.store" in reachable("weightfabric.fabric.worker")


def test_a_store_built_from_its_collaborators_publishes_and_fetches():
    """No `Worker` anywhere: a hub client, a read server and a transport selector."""
    hub = wf.serve("tcp://127.0.0.1:0", lease_s=5.0)
    made = []
    try:
        for name in ("a", "b"):
            server = ReadServer()
            client = wf.connect(hub.url, worker=name, endpoints={"read": server.address.to_dict()})
            transports = TransportSelector(timeout=5)
            store = ModelStore("m", hub=client, server=server, transports=transports,
                               chunk_size=64 * 1024)
            made.append((store, client, server, transports))
        (a, *_), (b, *_) = made
        tensors = {"w": torch.arange(100_000, dtype=torch.float32)}
        version = a.publish(tensors)
        assert b.fetch(version).version == version
        assert torch.equal(b.tensors["w"], tensors["w"])
    finally:
        for store, client, server, transports in made:
            store.close()
            client.close()
            server.close()
            transports.close()
        hub.stop()


def test_the_selector_asks_a_holder_once_per_region(monkeypatch):
    hub = wf.serve("tcp://127.0.0.1:0", lease_s=5.0)
    data = torch.zeros(4000, dtype=torch.uint8)
    with hub, wf.join(hub.url, worker="holder") as holder, \
            wf.join(hub.url, worker="reader") as reader:
        h, g = "h/v1/s0", "g/v1/s0"
        for region in (h, g):
            holder.server.expose(region, data, chunk_size=1000, shm_path="/dev/shm/x")
        asked = []
        describe = reader.transports.shm.describe

        def counting(address, region, **kw):
            asked.append(region)
            return describe(address, region, **kw)

        monkeypatch.setattr(reader.transports.shm, "describe", counting)
        source = Source("holder", reader_address(holder, h), h)
        for _ in range(3):
            assert reader.transport_for(source) is reader.transports.shm
        assert asked == [h]
        monkeypatch.setattr(selector_module, "MAX_DESCRIPTORS", 1)  # the newest region only
        other = Source("holder", reader_address(holder, g), g)
        for src in (other, source, source):
            reader.transports.transport_for(src)
        assert asked == [h, g, h]


@pytest.mark.parametrize("name", ["", "x" * 1100, "bad\udc80name"])
def test_a_name_no_read_server_can_expose_is_refused_before_any_hub_call(name):
    hub = wf.serve("tcp://127.0.0.1:0", lease_s=5.0)
    with hub, wf.join(hub.url, worker="w") as worker:
        calls = []
        call = worker.hub.call
        worker.hub.call = lambda op, *a, **kw: calls.append(op) or call(op, *a, **kw)
        with pytest.raises(BadRequestError, match="model name"):
            worker.model(name)
        assert calls == []
