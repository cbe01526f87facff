#!/usr/bin/env bash
# The next GPU session's measurements in one call of the device tool (docs/gpu.md, "Next GPU
# session"): a lent machine is rare and its time short (15 minutes a session, each start a minute
# or more of it), and earlier sessions lost calls to setting up. Each step runs under its own time
# cap, so that one which hangs or fails leaves the others their time, and whatever the steps
# wrote is packed into one archive under $OUT (the tool brings back at most 8 files).
#
#   here, before the call:  make gpu-devdata
#                           (Fashion-MNIST's four files, the char-LM's text and the commit, into
#                           the ignored .devdata/, about 37 MB of the 64 MiB a call carries)
#   the call:               bash bench/gpu_session.sh      carry [".devdata"], timeout_s 590
#   here, after:            tar xzf <files_at>/gpu_session.tgz
#                           (the result files land where the benchmarks write them; read, then
#                           commit them with the device's name, as docs/gpu.md says)
#
# The caps (seconds) add up to 540, inside a call's 600; change them with the variables below.
# With a machine's start (a minute or two) that leaves ~4 of a session's 15 minutes for a second
# call, made at once while the machine is warm (it goes back after 30 s idle).
# The steps, in order of what the open work needs most:
#   1. the tests of what the later steps run, on CUDA, in one process: the trainer's step
#      replayed from a CUDA graph (HybridConfig(cuda_graph=True)) against the eager one, the
#      deferred checks, the Gram norms (70 tests in 9 s on the H200 on 2026-11-28; under
#      pytest-xdist, 4 workers, they had not finished after 75 s, nor after 140);
#   2. the trainer with its steady step replayed from a CUDA graph, beside predict=False and
#      the plain loop, both models, with the replayed step's device memory (its graph's pool and
#      the side stream, one per process since 2026-11-28; before, 77 MB above a baseline 68 MB
#      higher than the plain loop's 9 MB): docs/results/overhead_cuda_fused.{json,md}, the
#      other figures kept;
#   3. the 51M-parameter MLP, whose step the device rather than the host bounds: what the
#      trainer's eager step costs where launches do not dominate (same file, --merge);
#   4. the Triton kernels' tests, compiled, in one process, as far as the cap allows.
set -u
cd "$(dirname "$0")/.."
TESTS_CAP=${TESTS_CAP:-60}
GRAPH_CAP=${GRAPH_CAP:-120}
BIG_CAP=${BIG_CAP:-200}
KERNELS_CAP=${KERNELS_CAP:-160}
PYTHON=${PYTHON:-python3}
DATA=${DEVDATA:-.devdata}
OUT=${OUT:-build/gpu_session}
LOGS=${GPU_SESSION_LOGS:-build/gpu_session_logs}  # emptied first: the tests give their own

if [ ! -f "$DATA/commit" ] || [ ! -d "$DATA/fashion-mnist" ] || [ ! -d "$DATA/bible" ]; then
    echo "gpu_session: $DATA/ is incomplete: run 'make gpu-devdata' here and carry .devdata" >&2
    exit 2
fi
DATA=$(cd "$DATA" && pwd)
mkdir -p "$OUT"
rm -rf "$LOGS" && mkdir -p "$LOGS"
export FASHION_MNIST_DIR="$DATA/fashion-mnist"
export PYTHONPATH="$PWD:$DATA${PYTHONPATH:+:$PYTHONPATH}"  # bible/ for the char-LM
export PYTHONUNBUFFERED=1
# The machine's .git is the one copied when the session began: the benchmarks record this commit
# instead (bench.protocol.git_state).
export HYBRID_BENCH_GIT_COMMIT
HYBRID_BENCH_GIT_COMMIT=$(sed -n 1p "$DATA/commit")
export HYBRID_BENCH_GIT_DIRTY
HYBRID_BENCH_GIT_DIRTY=$(sed -n 2p "$DATA/commit")

started=$SECONDS
status=0
step() {  # step NAME CAP COMMAND...: run COMMAND under CAP seconds, its output in $LOGS/NAME.log
    local name=$1 cap=$2
    shift 2
    echo "== $name (at most ${cap} s; $((SECONDS - started)) s into the call): $*"
    timeout --kill-after=10 "$cap" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOGS/$name.log"
    echo "== $name: exit $rc after $((SECONDS - started)) s"
    [ $rc -eq 0 ] || status=1
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'triton', triton.__version__)"
    echo "commit $HYBRID_BENCH_GIT_COMMIT (uncommitted changes: $HYBRID_BENCH_GIT_DIRTY)"
} 2>&1 | tee "$LOGS/machine.log"

# Without the commit variables: the tests' own result-metadata checks read the tree as it is. Before
# the benchmarks: a replay that fails its test must be known before its timing is read.
step tests "$TESTS_CAP" env -u HYBRID_BENCH_GIT_COMMIT -u HYBRID_BENCH_GIT_DIRTY "$PYTHON" -m pytest -q -p no:xdist \
    -p no:cacheprovider -p no:benchmark tests/test_captured_step.py tests/test_deferred_checks.py \
    tests/test_gram_norm.py
# The replayed step timed beside predict=False and the plain loop, interleaved in one process, and
# its memory in a fresh process (bench.overhead.arms_to_measure); the models' other figures kept
# from the committed file (2026-11-28, H200).
step overhead_cuda_graph "$GRAPH_CAP" "$PYTHON" -m bench.overhead --device cuda --fused-adamw \
    --models fashion charlm --steps 1000 --arms "predict=False, cuda_graph" "predict=False"
# Each arm of the 51M MLP steps in a process of its own: fewer timed steps than on a CPU core's
# default, no exploration (the CPU runs have it), memory over 20 steps.
step overhead_mlp50m "$BIG_CAP" "$PYTHON" -m bench.overhead --device cuda --fused-adamw --models mlp-50m \
    --steps 300 --explore-steps 0 --memory-steps 20 --merge
step kernels "$KERNELS_CAP" env -u HYBRID_BENCH_GIT_COMMIT -u HYBRID_BENCH_GIT_DIRTY "$PYTHON" -m pytest -q \
    -p no:xdist -p no:cacheprovider -p no:benchmark tests/test_apply_delta.py tests/test_int8_quant.py \
    tests/test_gru_cell.py tests/test_encode_state.py tests/test_flash_attention.py

# The result files this call wrote (not the committed ones a failed step left), and every log.
results=$(find docs/results/overhead_cuda_fused.* -newer "$LOGS/machine.log" 2>/dev/null)
# shellcheck disable=SC2086  # the result paths hold no spaces
tar czf "$OUT/gpu_session.tgz" $results "$LOGS"
echo "== packed into $OUT/gpu_session.tgz: $results $LOGS/ ($((SECONDS - started)) s in all)"
exit $status
