#!/usr/bin/env bash
# The one command for a GPU machine (under 10 minutes): the GPU tests, the lookup
# benchmarks at the target size and a short sweep, the table initialiser against the
# device's copy, and the train-step benchmark.
# Results go to bench/results/ as gpu_check_<device>_<date>*.jsonl, with a summary
# line per step in gpu_check_<device>_<date>.json. Each step has its own time
# limit; a failed step is recorded and the rest still run; the exit status is 1
# if any step failed, 2 if this machine has no GPU backend (nothing is written).
#
#   bash bench/gpu_check.sh            # from the repository root or anywhere
#   GPU_CHECK_OUT=/tmp/x bash bench/gpu_check.sh
#   GPU_CHECK_SKIP="lookup_sweep train_step" bash bench/gpu_check.sh   # steps left out
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-bench/results}
DATE=$(date -u +%F)

DEVICE=$(python - <<'PY'
import sys

import jax

if jax.default_backend() != "gpu":
    sys.exit(
        f"gpu_check: needs a GPU backend; jax.default_backend() is {jax.default_backend()!r} "
        "(install jax with CUDA, e.g. pip install 'jax[cuda13]', and run on a GPU machine; "
        "without one, tests/gpu_compile compiles for H100 deviceless)"
    )
print(jax.devices()[0].device_kind)
PY
) || exit 2
SLUG=$(echo "$DEVICE" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_' | tr 'A-Z' 'a-z')
PREFIX="$OUT/gpu_check_${SLUG}_${DATE}"
mkdir -p "$OUT"
SUMMARY="$PREFIX.json"
: > "$SUMMARY"
FAILED=0
echo "gpu_check: $DEVICE, results in $PREFIX*"

# step NAME LIMIT_S CMD...: runs CMD (stdout to PREFIX_NAME.jsonl) and records it.
step() {
    local name=$1 limit=$2
    shift 2
    case " ${GPU_CHECK_SKIP:-} " in *" $name "*) echo "== $name: skipped (GPU_CHECK_SKIP)"; return;; esac
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "${PREFIX}_${name}.jsonl" 2> "${PREFIX}_${name}.log"
    local rc=$?
    [ "$rc" -eq 0 ] || FAILED=1
    tail -n 3 "${PREFIX}_${name}.log"
    printf '{"step": "%s", "rc": %d, "timed_out": %s, "seconds": %d, "device": "%s", "date": "%s", "command": "%s"}\n' \
        "$name" "$rc" "$([ "$rc" -eq 124 ] && echo true || echo false)" "$((SECONDS - start))" \
        "$DEVICE" "$DATE" "$*" >> "$SUMMARY"
}

step tests 150 python -m pytest -q -p no:cacheprovider \
    tests/pallas/test_pallas_gpu.py tests/inference/test_quant_kernel.py tests/pallas/test_pallas_dispatch.py \
    tests/distributed/test_ragged_gpu.py tests/cache/test_cache_pipeline.py \
    "tests/cache/test_cache_exact.py::test_unsharded_exact"
step lookup_target 100 python bench/gpu_lookup.py --preset target --reps 20
step lookup_sweep 200 python bench/gpu_lookup.py --preset gpu_sweep --reps 5 --pass fwd,bwd_update
step init_rows 60 python bench/init_rows.py --dims 16 128 --mb 2048 --reps 10
step train_step 90 python bench/train_step.py --preset default --reps 10 --impl jaxrec,dense
step cache 200 python bench/cache.py --preset gpu
cat "$SUMMARY"
exit $FAILED
