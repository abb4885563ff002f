#!/bin/bash
# Every check that needs a GPU, in one run, for a machine lent with its own torch and a short
# time on it: the CUDA tests (device maps, pinned staging, CUDA IPC, the one-GPU device-map
# cases staged and by IPC, CUDA layouts on the wire), the IPC streams case 3 more times (it
# crashed a worker inside torch before transport/cuda_ipc.py kept torch's limbo occupied),
# torch's own CUDA test classes verbatim,
# then tools/bench_cuda.py; with CPU_BENCH=1, tools/bench.py too. Each piece has its own time
# limit; logs go to OUT_DIR.
#
#     [CPU_BENCH=1] bash tools/cuda_checks.sh [OUT_DIR]
#
# Uses the python3 that has torch with CUDA (or $PYTHON). Where it lacks pyzmq or expecttest (the
# lent machines here), bring their wheels in .whl/ (README, "Tests"); they go to /tmp/site.
set -u -o pipefail
py=${PYTHON:-python3}
out=${1:-cuda-checks}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PYTHONPATH:/tmp/site"
for module in zmq:pyzmq expecttest:expecttest; do  # (expecttest: torch's test modules import it)
    if ! "$py" -c "import ${module%%:*}" 2>/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
            .whl/"${module##*:}"*.whl || exit 1
    fi
done
start=$(date +%s)
step() { echo "[$(( $(date +%s) - start )) s] $*"; }
status=0
"$py" -c "import torch, zmq, msgpack; print('torch', torch.__version__, 'pyzmq', zmq.__version__, torch.cuda.get_device_name(0))" || exit 1

step "CUDA tests"
timeout 420 "$py" -m pytest -q -p no:cacheprovider -rA tests/rpc/test_devices.py tests/transport/test_cuda_ipc.py tests/transport/test_codec.py \
    tests/transport/test_endpoint.py tests/upstream/test_dist_autograd.py \
    -k "test_devices or test_cuda_ipc or (test_codec and cuda) or (test_endpoint and cuda) or (test_dist_autograd and gpu)" \
    > "$out/tests.txt" 2>&1 || status=1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$out/tests.txt" | tail -40

step "the IPC streams case, 3 more runs"
for run in 1 2 3; do
    timeout 60 "$py" -m pytest -q -p no:cacheprovider tests/upstream/test_dist_autograd.py \
        -k sync_streams_on_one_gpu_cuda_ipc > "$out/streams_$run.txt" 2>&1 || status=1
    echo "run $run: $(tail -1 "$out/streams_$run.txt")"
done

step "torch's own CUDA test classes, verbatim (tests/torch_suites)"
timeout 300 "$py" -m pytest -q -p no:cacheprovider -rA --timeout 120 tests/torch_suites/test_dist_autograd_test.py \
    tests/torch_suites/test_remote_module_test.py tests/torch_suites/test_ddp_under_dist_autograd_test.py \
    -k "Cuda" > "$out/torch_cuda_suites.txt" 2>&1 || status=1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$out/torch_cuda_suites.txt" | tail -30

step "tools/bench_cuda.py"
timeout 240 "$py" tools/bench_cuda.py --rounds 2 2>&1 | tee "$out/bench_cuda.txt" || status=1
if [ -n "${CPU_BENCH:-}" ]; then
    # The CPU benchmark on a machine with many cores (the development machines have 2), where
    # the 4 processes of a pipeline need not share vCPUs.
    step "tools/bench.py (CPU_BENCH)"
    timeout 300 "$py" tools/bench.py --rounds 5 --launches 2 --standalone-rounds 5 2>&1 | tee "$out/bench_cpu.txt" || status=1
fi
step "done"
exit $status
