"""The GPU libraries' calls the GPU code makes, checked against the wheels.

The nvshmem4py, cuda.core and cuda-bindings calls the GPU code makes, checked against the
installed wheels: names, argument names, what comes back. They import without a GPU, so a
version that renames or reshapes something fails here, not on a lent GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import inspect

import pytest
import torch

NO_NVSHMEM = importlib.util.find_spec("nvshmem") is None
NO_CUDA_PYTHON = importlib.util.find_spec("cuda") is None or importlib.util.find_spec(
    "cuda.bindings") is None


@pytest.mark.skipif(NO_NVSHMEM, reason="nvshmem4py not installed (gpu extra)")
def test_nvshmem_calls_bind_with_the_arguments_the_fabric_passes():
    import nvshmem.core as nvshmem

    t, s, buf = object(), object(), object()
    calls = {  # as in fabric/gpu/nvshmem_arena.py and fabric/transports/nvshmem.py
        nvshmem.init: ((), dict(device=None, uid=None, rank=0, nranks=1,
                                initializer_method="uid")),
        nvshmem.get_unique_id: ((), {}),
        nvshmem.tensor: (((8,),), dict(dtype=torch.uint8)),
        nvshmem.free_tensor: ((t,), {}),
        nvshmem.get_peer_tensor: ((t, 1), {}),
        nvshmem.get: ((buf, buf), dict(remote_pe=1, stream=s)),
        nvshmem.get_nbi: ((buf, buf), dict(remote_pe=1, stream=s)),
        nvshmem.quiet: ((), dict(stream=s)),
        nvshmem.signal_op: ((buf, 1, nvshmem.SignalOp.SIGNAL_SET), dict(remote_pe=0, stream=s)),
        nvshmem.signal_wait: ((buf, 1, nvshmem.ComparisonType.CMP_EQ), dict(stream=s)),
        nvshmem.barrier_all: ((), dict(stream=s)),
        nvshmem.my_pe: ((), {}),
        nvshmem.finalize: ((), {}),
        nvshmem.get_version: ((), {}),
    }
    for fn, (args, kwargs) in calls.items():
        inspect.signature(fn).bind(*args, **kwargs)  # TypeError names the call that changed
    assert {"libnvshmem_version", "nvshmem4py_version"} <= set(vars(nvshmem.Version()))


@pytest.mark.skipif(NO_NVSHMEM, reason="nvshmem4py not installed (gpu extra)")
def test_nvshmem_takes_torch_streams_and_cuda_core_byte_ranges():
    import nvshmem.core as nvshmem
    from cuda.core import Buffer
    from nvshmem.core.rma import _get_buffers

    class TorchLikeStream:  # what NvshmemStream reads from a torch.cuda.Stream
        cuda_stream = 0x1234

    stream = nvshmem.NvshmemStream(TorchLikeStream())
    assert stream.__cuda_stream__() == (0, 0x1234)
    dst, src = Buffer.from_handle(0x7F0000001000, 64), Buffer.from_handle(0x7F0000002008, 48)
    assert (dst.handle, dst.size) == (0x7F0000001000, 64)  # non-owning: no driver, no context
    assert _get_buffers(dst, src) == (dst, src)  # RMA operands may be Buffers (byte ranges)


@pytest.mark.skipif(NO_CUDA_PYTHON, reason="cuda-python not installed (gpu extra)")
def test_cuda_bindings_ipc_calls_return_an_error_code_first():
    from cuda.bindings import driver, runtime

    from weightfabric.fabric.transports.cuda_ipc import HANDLE_NBYTES, _check

    for fn in (runtime.cudaSetDevice, runtime.cudaIpcGetMemHandle, runtime.cudaIpcOpenMemHandle,
               runtime.cudaIpcCloseMemHandle, driver.cuMemGetAddressRange, runtime.cudaMalloc,
               runtime.cudaFree):
        assert callable(fn)
    handle = runtime.cudaIpcMemHandle_t()
    raw = bytes(range(HANDLE_NBYTES))
    ctypes.memmove(handle.getPtr(), raw, HANDLE_NBYTES)
    assert ctypes.string_at(handle.getPtr(), HANDLE_NBYTES) == raw
    assert isinstance(runtime.cudaIpcMemLazyEnablePeerAccess, int)
    assert _check((runtime.cudaError_t.cudaSuccess, 7), "x") == (7,)
    assert _check((runtime.cudaError_t.cudaSuccess,), "x") == ()
    with pytest.raises(RuntimeError, match="cudaIpcOpenMemHandle failed: .*cudaErrorInvalidValue"):
        _check((runtime.cudaError_t.cudaErrorInvalidValue, None), "cudaIpcOpenMemHandle")
    if torch.cuda.is_available():
        return  # the calls below would act on a real GPU; the GPU tests make them for real
    assert len(runtime.cudaSetDevice(0)) == 1  # (err,)
    assert len(runtime.cudaIpcGetMemHandle(0)) == 2  # (err, handle)
    assert len(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)) == 2
    assert len(runtime.cudaIpcCloseMemHandle(0)) == 1
    assert len(runtime.cudaMalloc(16)) == 2  # (err, pointer)
    assert len(runtime.cudaFree(0)) == 1
    assert isinstance(runtime.cudaError_t.cudaErrorMemoryAllocation, runtime.cudaError_t)
