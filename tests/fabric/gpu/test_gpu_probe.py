"""The GPU probe: never raises, says why a capability is missing."""

from __future__ import annotations

import pytest
import torch

from weightfabric.fabric.gpu.probe import Check, GpuProbe, normalise_uuid, probe


def test_probe_on_this_machine_reports_each_capability_with_a_reason():
    p = probe()
    for check in (p.cuda, p.nvshmem, p.peer, p.mps):
        assert check.reason
    if not torch.cuda.is_available():
        assert not p.cuda.ok and "torch.cuda.is_available() is False" in p.cuda.reason
        assert not p.peer.ok and p.peer.reason.startswith("needs CUDA")
        assert not p.nvshmem.ok and "nvshmem" in p.nvshmem.reason
        assert p.missing("cuda") == f"cuda: {p.cuda.reason}"
        assert p.devices == ()
    else:
        assert p.cuda.ok and len(p.devices) == torch.cuda.device_count()


def test_missing_is_none_only_when_every_need_is_met_and_rejects_unknown_needs():
    ok = Check(True, "fine")
    no = Check(False, "no daemon")
    p = GpuProbe(cuda=ok, nvshmem=ok, peer=ok, mps=no)
    assert p.missing("cuda", "nvshmem") is None
    assert p.missing("cuda", "mps") == "mps: no daemon"
    with pytest.raises(ValueError, match="unknown GPU capability 'tpu'"):
        p.missing("tpu")


def test_probe_never_raises_when_torch_cuda_blows_up(monkeypatch):
    def boom() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    p = probe()
    assert not p.cuda.ok and "torch.cuda raised RuntimeError: driver exploded" in p.cuda.reason


def test_mps_is_detected_by_its_control_pipe(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not probe().mps.ok and "nvidia-cuda-mps-control -d" in probe().mps.reason
    (tmp_path / "control").touch()
    assert probe().mps.ok


def test_gpu_uuids_from_torch_cuda_core_and_nvidia_smi_normalise_alike():
    a = "GPU-58a5f2a4-1c2b-3d4e-5f60-718293a4b5c6"
    assert normalise_uuid(a) == normalise_uuid(a.lower()[4:]) == "58a5f2a41c2b3d4e5f60718293a4b5c6"
    assert normalise_uuid("MIG-58A5F2A41C2B3D4E5F60718293A4B5C6") == normalise_uuid(a)
    with pytest.raises(ValueError, match="not a GPU UUID"):
        normalise_uuid("GPU-0")


def test_importing_fabric_needs_neither_cuda_python_nor_nvshmem():
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('cuda', 'nvshmem'):\n"
            "            raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import fabric, fabric.gpu, fabric.relayout.staging, fabric.transports.cuda_ipc\n"
            "import fabric.transports.nvshmem\n"
            "from fabric.gpu import probe\n"
            "assert 'blocked' in probe().cuda.reason or not probe().cuda.ok\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
