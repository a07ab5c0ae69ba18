"""`fabric topo validate|show` and the CLI's help."""

import json
import subprocess
import sys

import pytest
from paths import ROOT

from weightfabric.tools.cli import main
from weightfabric.topology import reference_clusters

EXAMPLE = ROOT / "tests" / "fixtures" / "clusters" / "contract-example.yaml"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightfabric.tools.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(reference_clusters()))
def test_validate_accepts_every_reference_cluster(name, capsys):
    assert main(["topo", "validate", str(reference_clusters()[name])]) == 0
    assert "valid" in capsys.readouterr().out


def test_validate_exits_2_with_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("bandwidth: 64GB/s", "bandwidth: 64GBs"))
    result = run_cli("topo", "validate", str(bad))
    assert result.returncode == 2
    assert f"{bad}:9: node_types.dgx-h100.pcie.bandwidth:" in result.stderr


def test_validate_exits_2_on_a_missing_file(tmp_path, capsys):
    assert main(["topo", "validate", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_show_json_has_the_documented_keys(capsys):
    assert main(["topo", "show", str(EXAMPLE), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["datacenters"], data["nodes"], data["gpus"], data["nics"]) == (2, 35, 280, 280)
    assert data["tiers"]["nvlink"] == [450e9]
    assert sorted(data["tiers"]["nic"]) == [50e9]
    assert data["wan"] == [{"between": ["dc-a", "dc-b"], "bandwidth": 12.5e9, "latency": 0.02}]


def test_show_prints_a_table(capsys):
    assert main(["topo", "show", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "280 GPUs" in out and "450 GB/s" in out and "dc-b" in out


@pytest.mark.parametrize("command", [["topo", "validate"], ["topo", "show"], ["topo", "draw"],
                                     ["topo", "discover"]])
def test_every_topo_command_explains_itself_with_an_example(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0
    assert "example" in result.stdout


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("weightfabric ")


def test_validate_counts_in_words_and_draw_to_a_bad_path_exits_2(tmp_path, capsys):
    local = reference_clusters()["localhost"]
    assert main(["topo", "validate", str(local)]) == 0
    assert "valid: 1 datacenter, 1 node, 0 GPUs, 1 NIC" in capsys.readouterr().out
    assert main(["topo", "draw", str(local), "-o", str(tmp_path / "no-dir" / "x.png")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_discover_to_a_bad_path_or_with_a_bad_name_exits_2(tmp_path, capsys):
    for path in (tmp_path / "no-dir" / "x.yaml", tmp_path):  # missing folder; a folder
        assert main(["topo", "discover", "-o", str(path)]) == 2
        assert "cannot write" in capsys.readouterr().err
    for name in ("a/b", "x{i}"):
        assert main(["topo", "discover", "--name", name]) == 2
        assert "--name: not a usable node name" in capsys.readouterr().err


# --- bad input is exit 2 with a message, never a traceback, hang or Infinity ----------

def test_a_quantity_that_overflows_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "inf.yaml"
    bad.write_text(EXAMPLE.read_text().replace("bandwidth: 25Gbps", "bandwidth: 1e400GB/s"))
    assert main(["topo", "show", str(bad), "--json"]) == 2
    err = capsys.readouterr()
    assert "'1e400GB/s' is too large to be a bandwidth" in err.err and "Infinity" not in err.out


def test_a_file_that_is_not_utf8_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(EXAMPLE.read_text().replace("two-datacenters", "caf\xe9").encode("latin-1"))
    assert main(["topo", "validate", str(bad)]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize(("chunk", "words"), [("0B", "positive, finite number of bytes"),
                                              ("1B", "use a chunk of at least")])
def test_plan_with_a_chunk_that_is_zero_or_far_too_small_is_exit_2(chunk, words, capsys):
    cluster = str(reference_clusters()["4x-dgx-h100"])
    assert main(["topo", "plan", cluster, "--size", "1GB", f"--chunk={chunk}"]) == 2
    assert words in capsys.readouterr().err


def test_simulate_with_zero_storage_bandwidth_is_exit_2(capsys):
    cluster = str(reference_clusters()["dgx-h100"])
    assert main(["topo", "simulate", cluster, "--scenario", "standalone", "--size", "1GB",
                 "--baselines", "storage", "--storage-bandwidth", "0GB/s"]) == 2
    assert "storage service's bandwidth must be a positive" in capsys.readouterr().err


def test_simulate_on_roles_without_a_reader_says_to_add_roles(capsys):
    assert main(["topo", "simulate", str(reference_clusters()["localhost"]),
                 "--scenario", "standalone"]) == 2
    err = capsys.readouterr().err
    assert "roles name no rollout device besides the trainer" in err and "--readers other" not in err
