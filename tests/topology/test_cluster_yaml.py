"""Loading, validating and dumping cluster YAML."""


import pytest
from paths import FIXTURES

from weightfabric.topology import (
    ClusterConfigError,
    load_cluster,
    loads_cluster,
    reference_clusters,
)

EXAMPLE = FIXTURES / "clusters" / "contract-example.yaml"


def example_text() -> str:
    return EXAMPLE.read_text()


def broken(old: str, new: str) -> str:
    text = example_text()
    assert old in text, old
    return text.replace(old, new, 1)


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_contract_example_loads_with_its_meaning():
    c = load_cluster(EXAMPLE)
    assert c.name == "two-datacenters"
    dgx = c.node_types["dgx-h100"]
    assert (dgx.gpus, dgx.gpu.model, dgx.gpu.memory) == (8, "H100-SXM", 80e9)
    assert dgx.nvlink.bandwidth == 450e9 and dgx.nvlink.latency == 2e-6
    assert dgx.nics.count == 8 and dgx.nics.bandwidth == 50e9 and dgx.nics.kind == "rdma"
    assert dgx.host_memory == 2e12
    assert c.node_types["cpu-box"].nics.kind == "tcp"
    names = [n.name for n in c.nodes()]
    assert names[:2] == ["a-0", "a-1"] and "a-15" in names and "trainer" in names
    assert len(names) == 16 + 1 + 18
    assert {n.nvlink_domain for n in c.nodes() if n.datacenter == "dc-b"} == {"rack-0"}
    assert c.datacenters[0].network.latency == 3e-6
    assert c.datacenters[1].network.oversubscription == 1.0
    assert c.wan[0].between == ("dc-a", "dc-b") and c.wan[0].latency == 0.02
    assert [n.name for n in c.role("trainer")] == ["trainer"]
    assert len(c.role("rollout")) == 34


@pytest.mark.parametrize("path", sorted(reference_clusters().values()), ids=lambda p: p.stem)
def test_reference_clusters_validate_and_round_trip(path):
    c = load_cluster(path)
    again = loads_cluster(c.to_yaml())
    assert again == c
    assert loads_cluster(again.to_yaml()).to_yaml() == c.to_yaml()


def test_reference_clusters_cover_the_issue_list():
    assert {"dgx-h100", "4x-dgx-h100", "two-datacenters", "heterogeneous", "localhost"} <= set(
        reference_clusters())


def test_contract_example_round_trips():
    c = load_cluster(EXAMPLE)
    assert loads_cluster(c.to_yaml()) == c


# (description, edit of the example, text on the reported line, field, words in the message)
BROKEN = [
    ("bad unit", ("bandwidth: 400Gbps", "bandwidth: 400Gbsp"), "400Gbsp",
     "node_types.dgx-h100.nics.bandwidth", "not a bandwidth"),
    ("bare number", ("bandwidth: 64GB/s", "bandwidth: 64"), "pcie:",
     "node_types.dgx-h100.pcie.bandwidth", "has no unit"),
    ("unknown key", ("host_memory: 2TB", "host_memroy: 2TB"), "host_memroy",
     "node_types.dgx-h100.host_memroy", "did you mean 'host_memory'"),
    ("dangling node type", ("type: dgx-h100, count: 18", "type: dgx-h200, count: 18"), "dgx-h200",
     "datacenters[1].nodes[0].type", "unknown node type 'dgx-h200'"),
    ("duplicate node name", ("{name: trainer, type: dgx-h100}", "{name: a-3, type: dgx-h100}"),
     "{name: a-3,", "datacenters[0].nodes[1].name", "duplicate node name 'a-3'"),
    ("duplicate datacenter", ("- name: dc-b", "- name: dc-a"), "- name: dc-a\n",
     "datacenters[1].name", "duplicate datacenter name"),
    ("zero bandwidth", ("bandwidth: 25Gbps", "bandwidth: 0Gbps"), "bandwidth: 0Gbps",
     "node_types.cpu-box.nics.bandwidth", "must be positive"),
    ("negative bandwidth", ("bandwidth: 100Gbps", "bandwidth: -100Gbps"), "-100Gbps",
     "wan[0].bandwidth", "must be positive"),
    ("wan to unknown datacenter", ("between: [dc-a, dc-b]", "between: [dc-a, dc-c]"), "dc-c",
     "wan[0].between", "unknown datacenter 'dc-c'"),
    ("count without placeholder", ('name: "a-{i}", type: dgx-h100, count: 16',
                                   'name: "a", type: dgx-h100, count: 16'),
     'name: "a",', "datacenters[0].nodes[0].name", "{i} placeholder"),
    ("unknown nic kind", ("kind: rdma", "kind: infiniband"), "infiniband",
     "node_types.dgx-h100.nics.kind", "unknown NIC kind"),
    ("role matching nothing", ('rollout: ["a-*", "b-*"]', 'rollout: ["a-*", "c-*"]'), '"c-*"',
     "roles.rollout", "matches no node"),
    ("wrong schema version", ("version: 1", "version: 2"), "version: 2", "version",
     "unsupported schema version"),
    ("missing required key", ("    gpus: 0\n", ""), "cpu-box:", "node_types.cpu-box.gpus",
     "required key is missing"),
    ("duplicate yaml key", ("    host_memory: 256GB\n", "    host_memory: 256GB\n    gpus: 1\n"),
     "    gpus: 1", "gpus", "duplicate key"),
    ("slash in a node name", ("{name: trainer, type", "{name: trainer/0, type"), "trainer/0",
     "datacenters[0].nodes[1].name", "contains '/'"),
    ("slash in a node pattern", ('name: "a-{i}"', 'name: "a/{i}"'), "a/{i}",
     "datacenters[0].nodes[0].name", "contains '/'"),
    ("slash in a datacenter name", ("- name: dc-b", "- name: dc/b"), "dc/b",
     "datacenters[1].name", "contains '/'"),
    ("slash in an nvlink domain", ("nvlink_domain: rack-0", "nvlink_domain: rack/0"), "rack/0",
     "datacenters[1].nodes[0].nvlink_domain", "contains '/'"),
    ("nvlink domain in two datacenters",
     ("{name: trainer, type: dgx-h100}", "{name: trainer, type: dgx-h100, nvlink_domain: rack-0}"),
     "count: 18, nvlink_domain", "datacenters[1].nodes[0].nvlink_domain",
     "already has nodes in datacenter 'dc-a'"),
    ("too many nodes", ("count: 18", "count: 99984"), "count: 99984",
     "datacenters[1].nodes[0].count", "at most 100,000"),
]


@pytest.mark.parametrize(("edit", "line_text", "field", "words"),
                         [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_yaml_names_file_line_and_field(edit, line_text, field, words, tmp_path):
    text = broken(*edit)
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ClusterConfigError) as info:
        load_cluster(path)
    err = info.value
    expected_line = text[:text.rindex(line_text)].count("\n") + 1
    assert err.line == expected_line, str(err)
    assert err.field == field
    assert words in str(err)
    assert str(err).startswith(f"{path}:{expected_line}: {field}: ")


def test_yaml_syntax_error_reports_the_line(tmp_path):
    text = broken("    host_memory: 256GB", "    host_memory: [256GB")
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ClusterConfigError, match="YAML syntax error") as info:
        load_cluster(path)
    assert info.value.line is not None and info.value.line >= line_of(text, "[256GB")


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ClusterConfigError, match="cannot read"):
        load_cluster(tmp_path / "nope.yaml")


def test_nvlink_groups_must_name_existing_gpus():
    text = broken("nvlink: {bandwidth: 450GB/s, latency: 2us}",
                  "nvlink: {bandwidth: 450GB/s, groups: [[0, 1], [7, 8]]}")
    with pytest.raises(ClusterConfigError, match="GPU 8 does not exist"):
        loads_cluster(text)


def test_nvlink_domain_needs_nvlink():
    text = broken("type: dgx-h100, count: 18, nvlink_domain", "type: cpu-box, count: 18, nvlink_domain")
    with pytest.raises(ClusterConfigError, match="has no nvlink"):
        loads_cluster(text)


def test_gpu_node_needs_pcie():
    text = broken("    pcie: {bandwidth: 64GB/s, latency: 2us}\n", "")
    with pytest.raises(ClusterConfigError, match="pcie: required when gpus > 0"):
        loads_cluster(text)


def test_error_is_a_value_error_and_exported_by_fabric():
    import weightfabric as wf
    assert issubclass(wf.ClusterConfigError, ValueError)
    assert wf.ClusterConfigError is ClusterConfigError


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"version: 1\nname: \xff\xfe\n")
    with pytest.raises(ClusterConfigError, match="not UTF-8 text") as info:
        load_cluster(path)
    assert info.value.line == 2 and str(info.value).startswith(f"{path}:2: ")


def test_a_file_may_describe_100000_nodes():
    text = broken("count: 18", "count: 99983")  # 16 + 1 + 99,983
    assert len(loads_cluster(text).nodes()) == 100_000
