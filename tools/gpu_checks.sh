#!/usr/bin/env bash
# The GPU checks (docs: "Results", "GPU") on a machine whose Python already
# has torch, jax and flax built for CUDA and that reaches no registry, so nox
# cannot build environments there. Keras, pure Python, may come as wheels in
# WHEELS (a folder), installed into a scratch directory first.
#
#   tools/gpu_checks.sh OUT [STAGE ...]
#
# Stages (default: all but bench, in this order):
#   info    the device and the packages' versions
#   tests   each backend's tests that take the GPU (-k gpu), in parallel
#   parity  every parity case on the GPU in every dtype, then the report
#   bench   the benchmark rows on the GPU (BENCH_ROWS: --only choices; long: the long
#           bfloat16 training pass, ours against SDPA's layer, PyTorch's alone), then
#           tools/gpu_step.py's decoding steps, tools/ragged_step.py's ragged ones
#           and tools/grouped_sdpa.py's SDPA
#   rows    PyTorch's speed rows alone, in about ten minutes: small calls, generation
#           (ours and the hand-written loop, eager and compiled) and the long pass
#
# Every stage's log and result lands in OUT; OUT.tar.gz holds them all.
set -u
out=${1:?usage: tools/gpu_checks.sh OUT [STAGE ...]}
shift
stages=${*:-info tests parity}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
py=${PYTHON:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MHA_MULTI_REQUIRE_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_FORCE_GPU_ALLOW_GROWTH=true
workers=${WORKERS:-4}

if [ -n "${WHEELS:-}" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-checks-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/gpu-checks-site"
fi
keras_backends=()
if "$py" -c "import keras" 2>/dev/null; then keras_backends=(jax torch); fi

# step NAME SECONDS COMMAND...: runs COMMAND with its log in OUT/NAME.log.
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    # Steps run in the background too: their exit status goes through a file.
    echo "$rc" >"$out/$name.exit"
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n 6 "$out/$name.log"
}

pytest_gpu=("$py" -m pytest -q -p no:cacheprovider -n "$workers" -k gpu)

for stage in $stages; do
    case $stage in
    info)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        "$py" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("numpy", "torch", "jax", "flax", "keras", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "absent")
EOF
        ;;
    tests)
        # One GPU, several processes: correctness only, timings come from bench.
        step tests-torch 420 env MHA_MULTI_BACKENDS=torch "${pytest_gpu[@]}" tests/backends tests/torch &
        step tests-jax 420 env MHA_MULTI_BACKENDS=jax-nnx,jax-linen "${pytest_gpu[@]}" \
            tests/backends tests/jax &
        for backend in "${keras_backends[@]}"; do
            KERAS_BACKEND=$backend step "tests-keras-$backend" 420 \
                env MHA_MULTI_BACKENDS="keras-$backend" "${pytest_gpu[@]}" tests/backends tests/keras &
        done
        wait
        ;;
    parity)
        "$py" -m mha_multi.parity cases "$out/cases" >/dev/null
        step parity-torch 420 "$py" -m mha_multi.parity run --devices gpu \
            --cases "$out/cases" --out "$out/results" torch &
        step parity-jax 420 "$py" -m mha_multi.parity run --devices gpu \
            --cases "$out/cases" --out "$out/results" jax-nnx jax-linen &
        for backend in "${keras_backends[@]}"; do
            KERAS_BACKEND=$backend step "parity-keras-$backend" 420 "$py" -m mha_multi.parity \
                run --devices gpu --cases "$out/cases" --out "$out/results" "keras-$backend" &
        done
        wait
        step parity-report 120 "$py" -m mha_multi.parity report --results "$out/results" \
            --cases "$out/cases" --out "$out/parity"
        rm -rf "$out/cases" "$out/results"
        ;;
    bench)
        # One process at a time: the GPU is timed alone.
        for backend in torch jax; do
            for rows in ${BENCH_ROWS:-timing small-calls generation long}; do
                step "bench-$backend-$rows" "${BENCH_SECONDS:-300}" "$py" -m mha_multi.bench run --devices gpu \
                    --only "$rows" --out "$out/bench-$rows" "$backend"
            done
        done
        # A decoding step's host time: the route, the generic flow, hand-written.
        for kv in 2 8; do
            step "gpu-step-$kv" 300 "$py" tools/gpu_step.py gpu 8 512 8 "$kv"
            # One sequence: the step's kernels are shortest, its host work the most of it.
            step "gpu-step-1-$kv" 300 "$py" tools/gpu_step.py gpu 1 512 8 "$kv"
        done
        # A ragged batch's step: the route (nothing read), the generic flow, hand-written.
        for kv in 2 8; do
            step "ragged-step-$kv" 300 "$py" tools/ragged_step.py "$kv" 8 rotary cuda
        done
        # ... with a window that hides keys, and with it sinks (gpt-oss's): on a GPU every
        # option takes the generic path's attention, which reads nothing.
        step "ragged-step-sliding" 300 "$py" tools/ragged_step.py 2 8 rotary sliding cuda
        step "ragged-step-sinks" 300 "$py" tools/ragged_step.py 2 8 rotary sliding sinks cuda
        # SDPA for a step's grouped heads: enable_gqa against the heads folded.
        for dtype in float32 bfloat16; do
            step "grouped-sdpa-$dtype" 120 "$py" tools/grouped_sdpa.py --device cuda \
                --dtype "$dtype" --keys 4096
        done
        ;;
    rows)
        # The speed rows a GPU answers (docs: "Results"), one process at a time: small
        # calls against nn.MultiheadAttention, generation against the hand-written loop
        # (eager, and compiled with CUDA graphs; float32 and bfloat16; plain, grouped and
        # Llama-shaped layers) and the long training pass against SDPA's layer.
        for rows in small-calls generation long; do
            ways=()
            [ "$rows" = generation ] && ways=(--ways cached,hand-written)
            step "rows-torch-$rows" "${BENCH_SECONDS:-300}" "$py" -m mha_multi.bench run \
                --devices gpu --only "$rows" ${ways[@]+"${ways[@]}"} --out "$out/rows-$rows" torch
        done
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
    esac
done

tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
failed=()
for file in "$out"/*.exit; do
    [ -e "$file" ] && [ "$(cat "$file")" != 0 ] && failed+=("$(basename "$file" .exit)")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
