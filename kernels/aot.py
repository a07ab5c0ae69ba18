"""Ahead-of-time compilation of every kernel for a GPU target, without a GPU.

Used by the test-suite to check that every kernel still compiles for Hopper
(sm_90) on a CPU-only machine. Run it in a process that has not launched an
interpreted kernel (the interpreter patches `triton.language` while it runs):
``TRITON_INTERPRET=0 python -m weightfabric.kernels.aot`` prints one JSON line per kernel and
exits 1 if any fails to compile.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER = ("cuda", 90, 32)


def kernel_specs() -> list[tuple[Any, dict[str, str], dict[str, int]]]:
    """(kernel, signature, constexprs) of every Triton kernel in `kernels`."""
    from weightfabric.kernels import checksum, delta, dequant_segments, fp8, packsum, segcopy

    return [*segcopy.aot_specs(), *checksum.aot_specs(), *packsum.aot_specs(), *fp8.aot_specs(),
            *dequant_segments.aot_specs(), *delta.aot_specs()]


def compile_kernel(kernel: Any, signature: dict[str, str], constexprs: dict[str, int],
                   target: tuple[str, int, int] = HOPPER, options: dict[str, Any] | None = None) -> Any:
    """Compile one kernel for ``target`` (backend, arch, warp size); returns the compiled kernel."""
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    # pointers 16-byte aligned, as the JIT specialises them for torch allocations
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs=attrs), target=GPUTarget(*target), options=options)


def main() -> int:
    """Compile every kernel for Hopper; one JSON line per kernel; exit 1 on any failure."""
    failed = 0
    for kernel, signature, constexprs in kernel_specs():
        name = getattr(kernel, "fn", kernel).__name__
        record: dict[str, Any] = {"kernel": name, "signature": signature, "constexprs": constexprs}
        try:
            compiled = compile_kernel(kernel, signature, constexprs)
            record.update(ok=True, cubin_bytes=len(compiled.asm["cubin"]),
                          sm90=".target sm_90" in compiled.asm["ptx"],
                          vector_loads=compiled.asm["ptx"].count("ld.global.v4"),
                          vector_stores=compiled.asm["ptx"].count("st.global.v4"),
                          float_negations=compiled.asm["ttir"].count("arith.negf"))
        except Exception as exc:  # report every kernel, then fail
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            failed += 1
        print(json.dumps(record), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
