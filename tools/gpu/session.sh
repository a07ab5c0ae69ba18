#!/usr/bin/env bash
# Everything the GPU data plane must run on a lent GPU, in as few device calls as
# possible. Run from the repository root on the GPU machine:
#
#   bash tools/gpu/session.sh check   # GPU, topology, probe, Hopper compile, discovery
#   bash tools/gpu/session.sh tests   # GPU tests (real Triton), then two PEs under MPS
#   bash tools/gpu/session.sh bench   # fabric bench fetch --device cuda (read sizes, 2 readers)
#   bash tools/gpu/session.sh bench2  # fabric bench kernels; NVSHMEM fetches between 2 PEs (MPS)
#   bash tools/gpu/session.sh all     # the four, in that order
#   bash tools/gpu/session.sh quick   # one call of under 9 minutes: the essentials of all four
#   bash tools/gpu/session.sh quickbench  # one call of under 6 minutes: the fetch benchmarks
#   bash tools/gpu/session.sh recheck     # under 6 minutes: GPU tests, kernels, sm_90 build, a fetch
#   bash tools/gpu/session.sh tune        # under 4 minutes: kernel launch settings, then the bench
#   bash tools/gpu/session.sh delta       # under 4 minutes: delta kernels and a delta fetch on the
#                                     # GPU, the delta codec bench, every GPU test, sm_90 build
#   bash tools/gpu/session.sh e2e         # under 9 minutes: GPU tests, kernels, a fetch, then time
#                                     # to version end to end on the GPU (fabric vs vLLM's CUDA
#                                     # IPC per tensor vs a device copy_), 1 and 4 readers
#                                     # (a task is lent 15 device minutes in all, starts included)
#
# Wheels from tools/gpu/fetch_wheels.sh are installed from .whl/ when present. Each
# step's full output (the JSON of a --json bench included) goes to $OUT/<step>.log;
# the tail of each is printed, and a table of exit codes comes last. The device tool
# brings back at most 8 files per call: run one phase per call. Each phase's step
# limits, plus 10 s of kill grace per step and the MPS start and stop, stay under the
# 600 s one call may take (a call cut off would lose the summary).
set -u
OUT=${OUT:-/tmp/weightfabric-gpu}
mkdir -p "$OUT"
LOGS=$OUT  # each step's log; quick packs them into one archive instead (8 files come back)
# MPS logs come back with the phase's logs (the default /var/log needs root)
export CUDA_MPS_LOG_DIRECTORY="$OUT/mps"
phase=${1:-all}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 1; }
fi
# the checkout is the package `weightfabric` (its root holds __init__.py): a link named
# so makes it importable without an install (the GPU image has no index to build from)
mkdir -p /tmp/wf-src && ln -sfn "$PWD" /tmp/wf-src/weightfabric
export PYTHONPATH="/tmp/wf-src:/tmp/site"
FABRIC=(python3 -m weightfabric.tools.cli)
summary=()

step() {  # step NAME TIMEOUT_S COMMAND...: run, log, print the tail, remember the exit code
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name: $*"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 12 "$LOGS/$name.log"
    summary+=("$(printf '%-28s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - start ))")")
    if [ -n "${PACK:-}" ]; then  # quick: every log in one archive, rewritten after each step
        printf '%s\n' "${summary[@]}" >"$LOGS/summary.txt"
        tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
    fi
}

mps_on() {  # start an MPS control daemon; its clients are the CUDA processes started after
    mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || echo "== MPS daemon did not start (already running?)"
    sleep 2
}

mps_off() {  # stop the daemon (one a killed earlier phase left behind too) and wait for it
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || return 0
    for _ in $(seq 20); do pgrep -f nvidia-cuda-mps-control >/dev/null || return 0; sleep 0.5; done
}

VERSIONS='
import importlib.metadata as md
for dist in ("torch", "triton", "numpy", "cuda-bindings", "cuda-core", "nvshmem4py-cu13",
             "nvidia-nvshmem-cu13"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
import nvshmem.core
print(nvshmem.core.get_version())
'

check() {
    step nvidia-smi 30 nvidia-smi
    step topo-m 30 nvidia-smi topo -m
    step probe 60 python3 -c "from weightfabric.fabric.gpu import probe; print(probe())"
    step versions 60 python3 -c "$VERSIONS"
    step aot-sm90 240 env TRITON_INTERPRET=0 python3 -m weightfabric.kernels.aot
    step discover 60 "${FABRIC[@]}" topo discover -o "$OUT/discovered.yaml"
}

tests() {
    step gpu-tests 280 env TRITON_INTERPRET=0 python3 -m pytest -rs -q -p no:cacheprovider \
        tests/fabric/gpu
    mps_on
    step mps-two-pes 250 env TRITON_INTERPRET=0 python3 -m pytest -rs -q -p no:cacheprovider \
        tests/fabric/gpu/test_gpu_nvshmem.py -k two_pes
    mps_off
}

bench() {  # the step limits add up to 520 s; each run adds the reshard section, only the
           # 64MiB run the one-PE NVSHMEM one
    step fetch-cuda-64MiB 150 "${FABRIC[@]}" bench fetch --device cuda --readers 1 \
        --size 4GB --chunk-size 64MiB --max-inflight 8 --versions 2 --json
    # 16MiB chunks read one per lease, then in spans of 256MiB (one lease each)
    for span in 16MiB 256MiB; do
        step "fetch-cuda-16MiB-reads-$span" 120 "${FABRIC[@]}" bench fetch --device cuda \
            --readers 1 --size 2GB --chunk-size 16MiB --read-bytes "$span" --max-inflight 8 \
            --versions 2 --nvshmem-pes 0 --json
    done
    step fetch-cuda-2-readers 130 "${FABRIC[@]}" bench fetch --device cuda --readers 2 \
        --size 2GB --chunk-size 64MiB --max-inflight 8 --versions 2 --nvshmem-pes 0 --json
}

bench2() {
    step kernels-cuda 280 env TRITON_INTERPRET=0 "${FABRIC[@]}" bench kernels --json
    mps_on
    step fetch-cuda-nvshmem-2pes 250 "${FABRIC[@]}" bench fetch --device cuda --readers 1 \
        --size 2GB --chunk-size 64MiB --versions 2 --nvshmem-pes 2 --no-baselines --json
    mps_off
}

packed() {  # the one-call phases: every log in one archive, $OUT/logs.tgz (8 files come back)
    PACK=1
    LOGS=/tmp/weightfabric-gpu-logs
    export CUDA_MPS_LOG_DIRECTORY="$LOGS/mps"
    mkdir -p "$LOGS"
}

quick() {  # the step limits add up to 500 s; logs come back as $OUT/logs.tgz
    packed
    step nvidia-smi 20 nvidia-smi
    step topo-m 20 nvidia-smi topo -m
    step versions 30 python3 -c "$VERSIONS"
    step probe 30 python3 -c "from weightfabric.fabric.gpu import probe; print(probe())"
    step discover 30 "${FABRIC[@]}" topo discover -o "$LOGS/discovered.yaml"
    step gpu-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -rs -q -p no:cacheprovider \
        --timeout=60 tests/fabric/gpu
    step kernels-cuda 80 env TRITON_INTERPRET=0 "${FABRIC[@]}" bench kernels --json --repeat 3
    step fetch-cuda-64MiB 80 "${FABRIC[@]}" bench fetch --device cuda --readers 1 \
        --size 2GB --chunk-size 64MiB --max-inflight 8 --versions 2 --json
    mps_on
    step mps-two-pes 60 env TRITON_INTERPRET=0 python3 -m pytest -rs -q -p no:cacheprovider \
        tests/fabric/gpu/test_gpu_nvshmem.py -k two_pes
    mps_off
}

quickbench() {  # the step limits add up to 330 s; logs come back as $OUT/logs.tgz
    packed
    step fetch-cuda-64MiB 80 "${FABRIC[@]}" bench fetch --device cuda --readers 1 \
        --size 2GB --chunk-size 64MiB --max-inflight 8 --versions 2 --json
    step fetch-cuda-16MiB-reads-256MiB 60 "${FABRIC[@]}" bench fetch --device cuda \
        --readers 1 --size 2GB --chunk-size 16MiB --read-bytes 256MiB --max-inflight 8 \
        --versions 2 --nvshmem-pes 0 --json
    step fetch-cuda-2-readers 70 "${FABRIC[@]}" bench fetch --device cuda --readers 2 \
        --size 2GB --chunk-size 64MiB --max-inflight 8 --versions 2 --nvshmem-pes 0 --json
    mps_on
    step fetch-cuda-nvshmem-2pes 90 "${FABRIC[@]}" bench fetch --device cuda --readers 1 \
        --size 2GB --chunk-size 64MiB --versions 2 --nvshmem-pes 2 --no-baselines --json
    mps_off
}

recheck() {  # after kernel changes: the step limits add up to 330 s
    packed
    step versions 30 python3 -c "$VERSIONS"
    step gpu-tests 120 env TRITON_INTERPRET=0 python3 -m pytest -rs -q -p no:cacheprovider \
        --timeout=60 tests/fabric/gpu
    step kernels-cuda 60 env TRITON_INTERPRET=0 "${FABRIC[@]}" bench kernels --json --repeat 5
    step aot-sm90 60 env TRITON_INTERPRET=0 python3 -m weightfabric.kernels.aot
    step fetch-cuda-64MiB 60 "${FABRIC[@]}" bench fetch --device cuda --readers 1 \
        --size 2GB --chunk-size 64MiB --max-inflight 8 --versions 2 --nvshmem-pes 0 --json
}

tune() {  # launch settings of the segment copy, checksum and fused pack+checksum kernels
          # (each checked against its torch reference), then the bench: 220 s
    packed
    step tune-kernels 180 env TRITON_INTERPRET=0 python3 tools/gpu/tune_kernels.py
    step kernels-cuda 40 env TRITON_INTERPRET=0 "${FABRIC[@]}" bench kernels --json --repeat 5
}

delta() {  # deltas on the GPU: the step limits add up to 230 s
    packed
    step versions 30 python3 -c "$VERSIONS"
    step gpu-delta-tests 60 env TRITON_INTERPRET=0 python3 -m pytest -rs -q -p no:cacheprovider \
        --timeout=50 tests/fabric/gpu/test_gpu_deltas.py
    step delta-cuda 50 env TRITON_INTERPRET=0 "${FABRIC[@]}" bench delta --device cuda --no-wan \
        --models demo --versions 3 --json
    step delta-cuda-64MiB 50 env TRITON_INTERPRET=0 "${FABRIC[@]}" bench delta --device cuda \
        --no-wan --models demo --versions 3 --chunk-size 64MiB --json
    step gpu-tests 90 env TRITON_INTERPRET=0 python3 -m pytest -rs -q -p no:cacheprovider \
        --timeout=60 tests/fabric/gpu
}

e2e() {  # time to version at HBM speed: the step limits add up to 505 s (555 s with each
         # step's 10 s of kill grace); logs come back as $OUT/logs.tgz
    packed
    step gpu-tests 140 env TRITON_INTERPRET=0 python3 -m pytest -rs -q -p no:cacheprovider \
        --timeout=60 tests/fabric/gpu
    step kernels-cuda 45 env TRITON_INTERPRET=0 "${FABRIC[@]}" bench kernels --json --repeat 3
    step fetch-cuda 60 "${FABRIC[@]}" bench fetch --device cuda --readers 1 --size 2GB \
        --chunk-size 64MiB --max-inflight 8 --versions 2 --nvshmem-pes 0 --json
    step e2e-cuda-1-reader 110 "${FABRIC[@]}" bench e2e --device cuda --readers 1 --size 2GB \
        --json
    step e2e-cuda-4-readers 150 "${FABRIC[@]}" bench e2e --device cuda --readers 4 --size 2GB \
        --json
}

mps_off  # none left over from an earlier call that was cut off
case "$phase" in
    check) check ;;
    tests) tests ;;
    bench) bench ;;
    bench2) bench2 ;;
    all) check; tests; bench; bench2 ;;
    quick) quick ;;
    quickbench) quickbench ;;
    recheck) recheck ;;
    tune) tune ;;
    delta) delta ;;
    e2e) e2e ;;
    *) echo "usage: bash tools/gpu/session.sh check|tests|bench|bench2|all|quick|quickbench|recheck|tune|delta|e2e"; exit 2 ;;
esac
echo "== summary (logs in $OUT)"
printf '%s\n' "${summary[@]}"
