#!/usr/bin/env bash
# Download, on a machine with internet access, the wheels the lent GPU machine lacks
# (it has torch, triton, cuda-bindings, cuda-core and libnvshmem, but no pyzmq, msgspec
# or nvshmem4py, and cannot reach a package index). They land in .whl/ (git-ignored);
# pass ".whl" in the device run's `carry` and run tools/gpu/session.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "nvshmem4py-cu13==0.4.1" "pyzmq>=25" "msgspec>=0.19"
ls -l .whl
