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
# With a machine's start (a minute or two) that leaves ~4 of a session's 15 minutes: a second
# call right after this one finds the machine warm (the compiled suite's tests, docs/gpu.md).
# The steps, in order of what the open work needs most:
#   1. the tests of what the later steps run, on CUDA: first the trainer's step replayed from a
#      CUDA graph (HybridConfig(cuda_graph=True)) against the eager one, which no GPU has run
#      yet; the deferred checks; the Gram norms;
#   2. the trainer's overhead with fused AdamW in every arm, against the goal predict=False
#      >= 0.97x the plain loop, Fashion-MNIST then the char-LM:
#      docs/results/overhead_cuda_fused.{json,md};
#   3. the same with the step replayed from a CUDA graph, beside predict=False, both models
#      (--arms: the other figures of step 2 kept), and that trainer's device memory on
#      Fashion-MNIST beside the plain loop's and predict=False's (in the logs).
# Runs where the device tool runs commands: the repository root, python3 holding a CUDA torch.
set -u
cd "$(dirname "$0")/.."
TESTS_CAP=${TESTS_CAP:-75}
FASHION_CAP=${FASHION_CAP:-150}
CHARLM_CAP=${CHARLM_CAP:-180}
GRAPH_CAP=${GRAPH_CAP:-90}
MEMORY_CAP=${MEMORY_CAP:-15}
PYTHON=${PYTHON:-python3}
DATA=${DEVDATA:-.devdata}
OUT=${OUT:-build/gpu_session}
LOGS=build/gpu_session_logs

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
# the benchmarks: a replay that fails its test must be known before its timing is read. (The
# fifth session's 60 s cap cut a run of three files at 8 workers: starting them takes most of it.)
step tests "$TESTS_CAP" env -u HYBRID_BENCH_GIT_COMMIT -u HYBRID_BENCH_GIT_DIRTY "$PYTHON" -m pytest -q -n 4 \
    -p no:cacheprovider -p no:benchmark tests/test_captured_step.py tests/test_deferred_checks.py \
    tests/test_gram_norm.py
# One model a run, merged into one result file: a run stopped at its cap writes nothing, so the
# char-LM's (the longer) cannot take Fashion-MNIST's figures with it. The char-LM timed over 20
# rounds of 50 steps, as the fourth session did: its memory runs take ~15 s an arm. (The fifth
# session's runs took 113 and 162 s.)
step overhead_fashion "$FASHION_CAP" "$PYTHON" -m bench.overhead --device cuda --fused-adamw --models fashion \
    --steps 2000 --memory-steps 40 --merge
step overhead_charlm "$CHARLM_CAP" "$PYTHON" -m bench.overhead --device cuda --fused-adamw --models charlm \
    --steps 1000 --memory-steps 40 --merge
# The replayed step timed beside predict=False and the plain loop, interleaved in one process; the
# models' other figures kept from the two runs above.
step overhead_cuda_graph "$GRAPH_CAP" "$PYTHON" -m bench.overhead --device cuda --fused-adamw \
    --models fashion charlm --steps 1000 --arms "predict=False, cuda_graph" "predict=False"
# The replayed trainer's device memory (allocator peak over 40 steps, a fresh process each), beside
# the plain loop's and predict=False's measured the same way: the graph keeps the gradients and its
# own pool between steps, which the benchmark's memory runs (every arm but this one) do not show.
step memory_plain "$MEMORY_CAP" "$PYTHON" -m bench.overhead --device cuda --fused-adamw --memory-steps 40 \
    --child fashion plain
step memory_predict_off "$MEMORY_CAP" "$PYTHON" -m bench.overhead --device cuda --fused-adamw --memory-steps 40 \
    --child fashion "predict=False"
step memory_cuda_graph "$MEMORY_CAP" "$PYTHON" -m bench.overhead --device cuda --fused-adamw --memory-steps 40 \
    --child fashion "predict=False, cuda_graph"

# The result files this call wrote (not the committed ones a failed step left), and every log.
results=$(find docs/results/overhead_cuda_fused.* -newer "$LOGS/machine.log" 2>/dev/null)
# shellcheck disable=SC2086  # the result paths hold no spaces
tar czf "$OUT/gpu_session.tgz" $results "$LOGS"
echo "== packed into $OUT/gpu_session.tgz: $results $LOGS/ ($((SECONDS - started)) s in all)"
exit $status
