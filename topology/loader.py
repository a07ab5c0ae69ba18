"""Load and validate cluster YAML.

Every error is a `ClusterConfigError` reading ``file:line: field: what is wrong``.
The YAML is parsed with a loader that remembers the line of every key and list
item, then validated field by field into the classes of `topology.schema`.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from weightfabric.topology.errors import ClusterConfigError
from weightfabric.topology.schema import (
    NIC_KINDS,
    Cluster,
    Datacenter,
    GpuSpec,
    LinkSpec,
    NetworkSpec,
    NicSpec,
    NodeGroup,
    NodeType,
    NumaSpec,
    NvlinkSpec,
    WanLink,
)
from weightfabric.topology.units import UnitError, parse_bandwidth, parse_latency, parse_size

T = TypeVar("T")
SCHEMA_VERSION = 1
#: Most nodes one file may describe (all groups' counts together): far above real
#: clusters, low enough that validating, planning and drawing stay fast.
MAX_NODES = 100_000


# --- YAML with line numbers -------------------------------------------------------

class _Map(dict):
    """A YAML mapping that remembers its own line and the line of each key."""

    line: int = 0
    key_lines: dict[Any, int]


class _Seq(list):
    """A YAML sequence that remembers its own line and the line of each item."""

    line: int = 0
    item_lines: list[int]


class _Loader(yaml.SafeLoader):
    pass


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> _Map:
    loader.flatten_mapping(node)
    out = _Map()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            raise _Problem(line, str(key), "keys must be strings")
        if key in out:
            raise _Problem(line, key, f"duplicate key (first given on line {out.key_lines[key]})")
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = line
    return out


def _construct_seq(loader: _Loader, node: yaml.SequenceNode) -> _Seq:
    out = _Seq(loader.construct_object(item, deep=True) for item in node.value)
    out.line = node.start_mark.line + 1
    out.item_lines = [item.start_mark.line + 1 for item in node.value]
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_seq)


class _Problem(Exception):
    """Raised inside validation; turned into ClusterConfigError with the source name."""

    def __init__(self, line: int | None, field: str, problem: str) -> None:
        super().__init__(problem)
        self.line, self.field, self.problem = line, field, problem


# --- public entry points --------------------------------------------------------

def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Read and validate a cluster YAML file.

    Raises:
        ClusterConfigError: the file is missing, is not UTF-8 text, is not YAML, or
            breaks the schema; the message names the file, line and field.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ClusterConfigError(f"cannot read: {exc.strerror or exc}", source=str(path)) from exc
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise ClusterConfigError(f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                                 f"{exc.start}); a cluster file is YAML written in UTF-8",
                                 source=str(path), line=line) from None
    return loads_cluster(text, source=str(path))


def loads_cluster(text: str, *, source: str = "<string>") -> Cluster:
    """Validate a cluster description given as YAML text (see `load_cluster`)."""
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
        return _cluster(data)
    except _Problem as p:
        raise ClusterConfigError(p.problem, source=source, line=p.line, field=p.field) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        what = " ".join(filter(None, [exc.context, exc.problem]))
        raise ClusterConfigError(f"YAML syntax error: {what}", source=source, line=line) from None
    except yaml.YAMLError as exc:
        raise ClusterConfigError(f"YAML syntax error: {exc}", source=source) from None


def cluster_from_dict(data: dict[str, Any], *, source: str = "<dict>") -> Cluster:
    """Validate a description given as plain data (as `Cluster.to_dict` returns it)."""
    return loads_cluster(yaml.safe_dump(data, sort_keys=False), source=source)


# --- field readers ----------------------------------------------------------------

def _line(container: Any, key: Any) -> int | None:
    if isinstance(container, _Map):
        return container.key_lines.get(key, container.line)
    if isinstance(container, _Seq) and isinstance(key, int) and key < len(container.item_lines):
        return container.item_lines[key]
    return getattr(container, "line", None)


def _mapping(value: Any, path: str, line: int | None, *, required: tuple[str, ...] = (),
             optional: tuple[str, ...] = (), any_keys: bool = False) -> _Map:
    if not isinstance(value, _Map):
        raise _Problem(line, path, f"expected a mapping, got {_kind(value)}")
    allowed = required + optional
    for key in [] if any_keys else value:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(allowed)}"
            raise _Problem(_line(value, key), _join(path, key), f"unknown key{hint}")
    for key in required:
        if key not in value:
            raise _Problem(line if line is not None else value.line, _join(path, key),
                           "required key is missing")
    return value


def _sequence(value: Any, path: str, line: int | None) -> _Seq:
    if not isinstance(value, _Seq):
        raise _Problem(line, path, f"expected a list, got {_kind(value)}")
    return value


def _field(container: _Map, key: str, path: str, parse: Callable[[Any], T]) -> T:
    """Parse container[key] with `parse`, turning its ValueError into a located problem."""
    try:
        return parse(container[key])
    except _Problem:
        raise
    except (UnitError, ValueError, TypeError) as exc:
        raise _Problem(_line(container, key), _join(path, key), str(exc)) from None


def _optional(container: _Map, key: str, path: str, parse: Callable[[Any], T],
              default: T) -> T:
    return _field(container, key, path, parse) if key in container else default


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    kinds: dict[type, str] = {dict: "a mapping", list: "a list", str: f"the text {value!r}"}
    return kinds.get(type(value).__mro__[-2], f"{type(value).__name__} {value!r}")


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty name, got {_kind(value)}")
    return value


def _address(value: Any) -> str:
    """A name that becomes part of device names (``node/gpu0``, ``dc/spine``): no '/'."""
    name = _name(value)
    if "/" in name:
        raise ValueError(f"{name!r} contains '/', which separates a node or datacenter from "
                         "its devices (as in n0/gpu0); choose a name without '/'")
    return name


def check_node_name(name: Any) -> str:
    """`name` if it can name one node (what ``fabric topo discover --name`` writes).

    Non-empty, without '/' and without the ``{i}`` placeholder of a group.

    Raises:
        ValueError: what is wrong with the name.
    """
    name = _address(name)
    if "{i}" in name:
        raise ValueError(f"{name!r} has an {{i}} placeholder, which only a group of nodes "
                         "with a count may have; give one node's name")
    return name


def _count(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected a whole number, got {_kind(value)}")
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def _positive(parse: Callable[[Any], float], what: str) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        number = parse(value)
        if number <= 0:
            raise ValueError(f"{what} must be positive, got {value!r}")
        return number
    return check


def _non_negative_latency(value: Any) -> float:
    seconds = parse_latency(value)
    if seconds < 0:
        raise ValueError(f"latency cannot be negative, got {value!r}")
    return seconds


_bandwidth = _positive(parse_bandwidth, "bandwidth")
_size = _positive(parse_size, "size")


def _int_list(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"expected a list of non-negative whole numbers, got {_kind(value)}")
    return tuple(value)


# --- sections -----------------------------------------------------------------------

def _cluster(data: Any) -> Cluster:
    top = _mapping(data, "", 1, required=("version", "name", "node_types", "datacenters"),
                   optional=("wan", "roles"))
    version = _field(top, "version", "", _count(1))
    if version != SCHEMA_VERSION:
        raise _Problem(_line(top, "version"), "version",
                       f"unsupported schema version {version}; this weightfabric reads version {SCHEMA_VERSION}")
    name = _field(top, "name", "", _name)

    raw_types = _mapping(top["node_types"], "node_types", _line(top, "node_types"),
                         any_keys=True)
    if not raw_types:
        raise _Problem(_line(top, "node_types"), "node_types", "at least one node type is needed")
    node_types = {key: _node_type(key, value, raw_types) for key, value in raw_types.items()}

    raw_dcs = _sequence(top["datacenters"], "datacenters", _line(top, "datacenters"))
    if not raw_dcs:
        raise _Problem(_line(top, "datacenters"), "datacenters", "at least one datacenter is needed")
    datacenters = tuple(_datacenter(raw_dcs, i, node_types) for i in range(len(raw_dcs)))
    _check_node_count(raw_dcs, datacenters)
    _check_unique_names(raw_dcs, datacenters)
    _check_domains(raw_dcs, datacenters)

    wan = _wan(top, datacenters) if "wan" in top else ()
    cluster = Cluster(name=name, node_types=node_types, datacenters=datacenters, wan=wan,
                      version=version)
    roles = _roles(top, [n.name for n in cluster.nodes()]) if "roles" in top else {}
    return Cluster(name=name, node_types=node_types, datacenters=datacenters, wan=wan,
                   roles=roles, version=version)


def _node_type(name: str, value: Any, parent: _Map) -> NodeType:
    path = f"node_types.{name}"
    raw = _mapping(value, path, _line(parent, name), required=("gpus",),
                   optional=("gpu", "nvlink", "pcie", "nics", "host_memory", "numa"))
    gpus = _field(raw, "gpus", path, _count(0))
    gpu = nvlink = pcie = nics = numa = None
    if "gpu" in raw:
        g = _mapping(raw["gpu"], f"{path}.gpu", _line(raw, "gpu"), required=("model",),
                     optional=("memory",))
        gpu = GpuSpec(model=_field(g, "model", f"{path}.gpu", _name),
                      memory=_optional(g, "memory", f"{path}.gpu", _size, None))
    if "nvlink" in raw:
        nvlink = _nvlink(raw, path, gpus)
    if "pcie" in raw:
        pcie = _link(raw, "pcie", path)
    if "nics" in raw:
        nics = _nics(raw, path)
    if "numa" in raw:
        numa = _numa(raw, path, gpus, nics.count if nics else 0)
    for key, needed in (("gpu", gpu), ("pcie", pcie)):
        if gpus > 0 and needed is None:
            raise _Problem(raw.line, f"{path}.{key}", f"required when gpus > 0 (gpus is {gpus})")
    if gpus == 0 and (gpu is not None or nvlink is not None):
        key = "gpu" if gpu is not None else "nvlink"
        raise _Problem(_line(raw, key), f"{path}.{key}", "given, but gpus is 0")
    return NodeType(name=name, gpus=gpus, gpu=gpu, nvlink=nvlink, pcie=pcie, nics=nics,
                    host_memory=_optional(raw, "host_memory", path, _size, None), numa=numa)


def _link(parent: _Map, key: str, path: str) -> LinkSpec:
    raw = _mapping(parent[key], f"{path}.{key}", _line(parent, key), required=("bandwidth",),
                   optional=("latency",))
    return LinkSpec(bandwidth=_field(raw, "bandwidth", f"{path}.{key}", _bandwidth),
                    latency=_optional(raw, "latency", f"{path}.{key}", _non_negative_latency, 0.0))


def _nvlink(parent: _Map, path: str, gpus: int) -> NvlinkSpec:
    npath = f"{path}.nvlink"
    raw = _mapping(parent["nvlink"], npath, _line(parent, "nvlink"), required=("bandwidth",),
                   optional=("latency", "groups"))
    groups = None
    if "groups" in raw:
        groups = _field(raw, "groups", npath,
                        lambda v: tuple(_int_list(g) for g in _list_of_lists(v)))
        seen: set[int] = set()
        for gpu in (g for group in groups for g in group):
            if gpu >= gpus:
                raise _Problem(_line(raw, "groups"), f"{npath}.groups",
                               f"GPU {gpu} does not exist (the node type has {gpus} GPUs)")
            if gpu in seen:
                raise _Problem(_line(raw, "groups"), f"{npath}.groups", f"GPU {gpu} is in two groups")
            seen.add(gpu)
    return NvlinkSpec(bandwidth=_field(raw, "bandwidth", npath, _bandwidth),
                      latency=_optional(raw, "latency", npath, _non_negative_latency, 0.0),
                      groups=groups)


def _list_of_lists(value: Any) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(g, list) for g in value):
        raise ValueError(f"expected a list of GPU lists such as [[0, 1], [2, 3]], got {_kind(value)}")
    return value


def _nics(parent: _Map, path: str) -> NicSpec:
    npath = f"{path}.nics"
    raw = _mapping(parent["nics"], npath, _line(parent, "nics"), required=("count", "bandwidth"),
                   optional=("kind", "latency", "names"))
    count = _field(raw, "count", npath, _count(1))
    kind = _optional(raw, "kind", npath, _name, "rdma")
    if kind not in NIC_KINDS:
        raise _Problem(_line(raw, "kind"), f"{npath}.kind",
                       f"unknown NIC kind {kind!r}; use one of {', '.join(NIC_KINDS)}")
    names = None
    if "names" in raw:
        names = _field(raw, "names", npath, lambda v: tuple(_name(x) for x in _plain_list(v)))
        if len(names) != count:
            raise _Problem(_line(raw, "names"), f"{npath}.names",
                           f"{len(names)} names given for {count} NICs")
    return NicSpec(count=count, bandwidth=_field(raw, "bandwidth", npath, _bandwidth), kind=kind,
                   latency=_optional(raw, "latency", npath, _non_negative_latency, 0.0), names=names)


def _plain_list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {_kind(value)}")
    return value


def _numa(parent: _Map, path: str, gpus: int, nics: int) -> NumaSpec:
    npath = f"{path}.numa"
    raw = _mapping(parent["numa"], npath, _line(parent, "numa"), optional=("gpus", "nics"))
    numa = NumaSpec(gpus=_optional(raw, "gpus", npath, _int_list, ()),
                    nics=_optional(raw, "nics", npath, _int_list, ()))
    for key, values, expected in (("gpus", numa.gpus, gpus), ("nics", numa.nics, nics)):
        if key in raw and len(values) != expected:
            raise _Problem(_line(raw, key), f"{npath}.{key}",
                           f"{len(values)} NUMA nodes given for {expected} {key.upper()[:-1]}s")
    return numa


def _datacenter(raw_dcs: _Seq, index: int, node_types: dict[str, NodeType]) -> Datacenter:
    path = f"datacenters[{index}]"
    raw = _mapping(raw_dcs[index], path, _line(raw_dcs, index), required=("name", "nodes"),
                   optional=("network",))
    name = _field(raw, "name", path, _address)
    network = NetworkSpec()
    if "network" in raw:
        net_path = f"{path}.network"
        net = _mapping(raw["network"], net_path, _line(raw, "network"),
                       optional=("oversubscription", "latency", "nodes_per_leaf"))
        network = NetworkSpec(
            oversubscription=_optional(net, "oversubscription", net_path, _ratio, 1.0),
            latency=_optional(net, "latency", net_path, _non_negative_latency, 0.0),
            nodes_per_leaf=_optional(net, "nodes_per_leaf", net_path, _count(1), 1),
        )
    raw_groups = _sequence(raw["nodes"], f"{path}.nodes", _line(raw, "nodes"))
    if not raw_groups:
        raise _Problem(_line(raw, "nodes"), f"{path}.nodes", "a datacenter needs at least one node")
    groups = tuple(_node_group(raw_groups, i, f"{path}.nodes", node_types)
                   for i in range(len(raw_groups)))
    return Datacenter(name=name, nodes=groups, network=network)


def _ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number such as 1.0 or 3, got {_kind(value)}")
    if value < 1:
        raise ValueError(f"oversubscription is a ratio >= 1 (1.0 = non-blocking), got {value}")
    return float(value)


def _node_group(raw_groups: _Seq, index: int, parent_path: str,
                node_types: dict[str, NodeType]) -> NodeGroup:
    path = f"{parent_path}[{index}]"
    raw = _mapping(raw_groups[index], path, _line(raw_groups, index), required=("name", "type"),
                   optional=("count", "nvlink_domain"))
    name = _field(raw, "name", path, _address)
    type_name = _field(raw, "type", path, _name)
    if type_name not in node_types:
        close = difflib.get_close_matches(type_name, list(node_types), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(node_types)}"
        raise _Problem(_line(raw, "type"), f"{path}.type",
                       f"unknown node type {type_name!r} ({hint})")
    count = _optional(raw, "count", path, _count(1), None)
    if count is not None and "{i}" not in name:
        raise _Problem(_line(raw, "name"), f"{path}.name",
                       f"count is {count}, so the name needs an {{i}} placeholder, e.g. {name}-{{i}}")
    if count is None and "{i}" in name:
        raise _Problem(_line(raw, "name"), f"{path}.name",
                       "the name has an {i} placeholder but no count is given")
    domain = _optional(raw, "nvlink_domain", path, _address, None)
    if domain is not None and node_types[type_name].nvlink is None:
        raise _Problem(_line(raw, "nvlink_domain"), f"{path}.nvlink_domain",
                       f"node type {type_name!r} has no nvlink, so it cannot join an NVLink domain")
    return NodeGroup(name=name, type=type_name, count=count, nvlink_domain=domain)


def _check_node_count(raw_dcs: _Seq, datacenters: tuple[Datacenter, ...]) -> None:
    """At most `MAX_NODES` nodes in all; checked before any group's names are expanded."""
    total = 0
    for i, dc in enumerate(datacenters):
        for j, group in enumerate(dc.nodes):
            total += group.count or 1
            if total > MAX_NODES:
                raw = raw_dcs[i]["nodes"][j]
                key = "count" if group.count else "name"
                raise _Problem(_line(raw, key), f"datacenters[{i}].nodes[{j}].{key}",
                               f"the file describes more than {MAX_NODES:,} nodes (this group "
                               f"brings the total to {total:,}); a cluster file holds at most "
                               f"{MAX_NODES:,}")


def _check_domains(raw_dcs: _Seq, datacenters: tuple[Datacenter, ...]) -> None:
    """Every node of an ``nvlink_domain`` is in one datacenter (NVLink does not cross a WAN)."""
    home: dict[str, tuple[str, str]] = {}
    for i, dc in enumerate(datacenters):
        for j, group in enumerate(dc.nodes):
            domain = group.nvlink_domain
            if domain is None:
                continue
            first_dc, first_path = home.setdefault(domain, (dc.name, f"datacenters[{i}].nodes[{j}]"))
            if first_dc != dc.name:
                raise _Problem(_line(raw_dcs[i]["nodes"][j], "nvlink_domain"),
                               f"datacenters[{i}].nodes[{j}].nvlink_domain",
                               f"NVLink domain {domain!r} already has nodes in datacenter "
                               f"{first_dc!r} ({first_path}); a domain's nodes must all be in "
                               "one datacenter")


def _check_unique_names(raw_dcs: _Seq, datacenters: tuple[Datacenter, ...]) -> None:
    dc_seen: dict[str, int] = {}
    node_seen: dict[str, str] = {}
    for i, dc in enumerate(datacenters):
        raw_dc = raw_dcs[i]
        if dc.name in dc_seen:
            raise _Problem(_line(raw_dc, "name"), f"datacenters[{i}].name",
                           f"duplicate datacenter name {dc.name!r} (also datacenters[{dc_seen[dc.name]}])")
        dc_seen[dc.name] = i
        for j, group in enumerate(dc.nodes):
            for node in group.names():
                if node in node_seen:
                    raise _Problem(_line(raw_dc["nodes"], j), f"datacenters[{i}].nodes[{j}].name",
                                   f"duplicate node name {node!r} (also in {node_seen[node]})")
                node_seen[node] = f"datacenters[{i}].nodes[{j}]"


def _wan(top: _Map, datacenters: tuple[Datacenter, ...]) -> tuple[WanLink, ...]:
    raw_links = _sequence(top["wan"], "wan", _line(top, "wan"))
    known = {dc.name for dc in datacenters}
    links: list[WanLink] = []
    seen: dict[frozenset[str], int] = {}
    for i in range(len(raw_links)):
        path = f"wan[{i}]"
        raw = _mapping(raw_links[i], path, _line(raw_links, i), required=("between", "bandwidth"),
                       optional=("latency",))
        between = _field(raw, "between", path, _pair)
        for dc in between:
            if dc not in known:
                raise _Problem(_line(raw, "between"), f"{path}.between",
                               f"unknown datacenter {dc!r} (known: {', '.join(sorted(known))})")
        key = frozenset(between)
        if key in seen:
            raise _Problem(_line(raw, "between"), f"{path}.between",
                           f"a second link between {between[0]} and {between[1]} (also wan[{seen[key]}])")
        seen[key] = i
        links.append(WanLink(between=between, bandwidth=_field(raw, "bandwidth", path, _bandwidth),
                             latency=_optional(raw, "latency", path, _non_negative_latency, 0.0)))
    return tuple(links)


def _pair(value: Any) -> tuple[str, str]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"expected two datacenter names such as [dc-a, dc-b], got {_kind(value)}")
    a, b = _name(value[0]), _name(value[1])
    if a == b:
        raise ValueError(f"a WAN link joins two different datacenters, got {a!r} twice")
    return a, b


def _roles(top: _Map, node_names: list[str]) -> dict[str, tuple[str, ...]]:
    raw = _mapping(top["roles"], "roles", _line(top, "roles"), optional=("trainer", "rollout"))
    roles: dict[str, tuple[str, ...]] = {}
    for role in raw:
        patterns = _field(raw, role, "roles", lambda v: tuple(_name(x) for x in _plain_list(v)))
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in node_names):
                raise _Problem(_line(raw, role), f"roles.{role}",
                               f"{pattern!r} matches no node of the cluster")
        roles[role] = patterns
    return roles
