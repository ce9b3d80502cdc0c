#!/usr/bin/env bash
# The one command for a GPU machine (under 10 minutes): the GPU tests, the lookup
# benchmarks at the target size (uniform and Zipf ids) and at HBM-bound sizes (three
# optimizers), the table initialiser against the device's copy, the train-step benchmark,
# the cached-table benchmark and the dynamic tables' forward.
# Results go to bench/results/ as gpu_check_<device>_<date>*.jsonl, with a summary
# line per step in gpu_check_<device>_<date>.json. Each step has its own time
# limit; a failed step is recorded and the rest still run; the exit status is 1
# if any step failed, 2 if this machine has no GPU backend (nothing is written).
#
#   bash bench/gpu_check.sh            # from the repository root or anywhere
#   GPU_CHECK_OUT=/tmp/x bash bench/gpu_check.sh
#   GPU_CHECK_SKIP="lookup_hbm train_step" bash bench/gpu_check.sh   # steps left out
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

# Time limits: 570 s in all, under ~570 (the device is lent for 15 minutes, start-up
# included). Estimates from the H200 run of 2026-11-26 (bench/results/gpu_check_nvidia_h200_*)
# where a step ran there, otherwise arithmetic; compile times are XLA's deviceless GPU
# compiles of the same programs on the 2-core development machine (jaxrec.deviceless).
#
# tests: 59 s and 87 s measured (the latter with the cache tests), + the balanced fused
# backward on Zipf ids (6 compiles, 100K ids) and the Mosaic GPU forward (7 tests, first
# lowering under JAX 0.11), ~3-5 s each: ~140 s; + the device slot map's XLA plan
# against its reference loop (11 small compiles, ~1 s each): 160 s.
step tests 160 python -m pytest -q -p no:cacheprovider \
    tests/pallas/test_pallas_gpu.py tests/inference/test_quant_kernel.py tests/pallas/test_pallas_dispatch.py \
    tests/distributed/test_ragged_gpu.py tests/cache/test_cache_pipeline.py tests/cache/test_sets.py \
    "tests/cache/test_cache_exact.py::test_unsharded_exact"
# lookup_target: uniform and Zipf 1.15 at T=8, E=1M, D=128, B=65,536, L=20, row-wise
# Adagrad, every implementation. The target alone took 43-51 s (with three table draws
# and ~19 GB of full tables and sequence outputs copied to the host); now one table
# serves both workloads and only checked rows come back. Start-up ~10 s + compiles
# ~25 s (2 forwards, 2 sequence lookups, 3 updates at 4-12 s) + per workload ~15 s
# (10.5M ids drawn and sorted ~5 s, float64 checks ~3 s, torch's 4 GB host copy, ~50
# steps of at most 68 ms: torch's and the old schedule's on Zipf) x 2 = ~65 s: 100 s.
step lookup_target 100 python bench/gpu_lookup.py --preset target,target_zipf --reps 20
# lookup_hbm: 4 tables of 10M rows (20.5 GB), B=65,536, L=20, uniform and Zipf 1.05 / 1.2,
# SGD, row-wise Adagrad and Adam, Pallas (both schedules), Mosaic (forward) and XLA:
# start-up 10 s + the table drawn once ~5 s + compiles on the first workload ~65 s (3
# forwards; 9 updates at 5-9 s) + per workload ~10 s (5.24M ids drawn and sorted ~3 s,
# float64 checks ~3 s in 8 threads, 3 x 7 forwards and 9 x 7 updates of at most ~50 ms,
# gathers and restores) x 3 = ~110 s: 125 s.
step lookup_hbm 125 python bench/gpu_lookup.py --preset hbm_check --impl pallas,pallas_per_run,mosaic,xla \
    --pass fwd,bwd_update --optimizer sgd,rowwise_adagrad,adam --reps 5 --warmup 1
# init_rows: 2 dims x 11 draws and copies of 2 GiB: under 10 s at 50 GB/s, 44 s at 1 GB/s
# (the H200 ran far faster than 1 GB/s): 40 s.
step init_rows 40 python bench/init_rows.py --dims 16 128 --mb 2048 --reps 10
# train_step: 14 s and 19 s measured: 30 s.
step train_step 30 python bench/train_step.py --preset default --reps 10 --impl jaxrec,dense
# cache: its gpu preset at Zipf 1.05 and two load factors, shorter warm-up: start-up and
# 4 GB model ~20 s + 2 cached models (host tables, compile ~10 s each) + 22 steps each of
# 0.24 s and 0.10 s (measured 2026-11-26) = ~50 s, + the slot maps' plan on the device
# (4 tables of 163,840 ids: 21 s deviceless on 2 cores) for each cached model: 85 s.
step cache 85 python bench/cache.py --preset gpu --alphas 1.05 --load-factors 0.1,1.0 \
    --warmup 10 --reps 5
# dynamic_table: 2 dynamic tables of 1M slots against plain tables, forward only (eval and
# the training forward with admission, eviction and reset: the XLA index on a GPU), 10
# fill calls: start-up ~10 s, 3 compiles (the index's ~2 s each on XLA:CPU) and
# 10 + 3 x 7 calls of a few ms: 30 s.
step dynamic_table 30 python bench/dynamic_table.py --preset default --T 2 --reps 5 --warmup 2 \
    --fill-steps 10 --occ-steps 0 --no-train-step
# (bench/gpu_lookup.py --preset gpu_sweep, which ran past 150 s, is left to a run of its own.)
cat "$SUMMARY"
exit $FAILED
