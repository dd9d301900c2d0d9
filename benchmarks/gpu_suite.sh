#!/usr/bin/env bash
# One-GPU benchmark suite (issue 9): bf16 matmul peak, the MoE layer alone (every backend, grouped's
# tile variants, a breakdown of where the time goes), then the train step of gpu-small and gpu-medium
# under capacity / grouped / ep / dropless and their equal-FLOP dense counterparts.
#
#   benchmarks/gpu_suite.sh OUTDIR                      # on an H200: ~5-7 minutes, capped at 7.5
#   MOELAB_SUITE_TINY=1 benchmarks/gpu_suite.sh OUTDIR  # CPU-sized shapes, same logic (also the default without a GPU)
#
# Writes OUTDIR/matmul.json, OUTDIR/moe_layer.json and OUTDIR/mfu_PRESET_BACKEND.json (one per run; a run
# that times out or crashes still gets a file, with "status" saying so), then prints the tables and
# issue 9's targets and writes OUTDIR/record.json (benchmarks/suite_table.py OUTDIR --record ...), the
# file to commit as benchmarks/results/<device>-<date>.json. Set MOELAB_COMMIT where the tree has no .git.
# Python: $MOELAB_PYTHON, else python3, with src/ on PYTHONPATH.
# Compiled programs are cached in $MOELAB_JAX_CACHE (default /tmp/moelab_jax_cache), so a rerun compiles less.
set -u
OUT=${1:?usage: benchmarks/gpu_suite.sh OUTDIR}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
PY=${MOELAB_PYTHON:-python3}
BUDGET_S=${MOELAB_SUITE_BUDGET_S:-450}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export JAX_COMPILATION_CACHE_DIR=${MOELAB_JAX_CACHE:-/tmp/moelab_jax_cache}

MOE_PRESETS="gpu-small gpu-medium"
BACKENDS="capacity grouped ep dropless"  # dropless last: ragged_dot's GPU fallback is the slow one (design §6)

# MOELAB_SUITE_TINY unset: tiny unless JAX sees a GPU; 1: tiny; 0: the full shapes wherever we are.
if [ -z "${MOELAB_SUITE_TINY:-}" ] && [ "$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)" != "gpu" ]; then
  echo "gpu_suite: no GPU visible to JAX; running the tiny shapes (MOELAB_SUITE_TINY=1)" >&2
  MOELAB_SUITE_TINY=1
fi

# stub FILE STATUS DETAIL: the JSON a run that left no file of its own gets.
stub() {
  printf '{"benchmark": "%s", "status": "%s", "error": "%s"}\n' "$4" "$2" "$3" > "$1"
}

if [ "${MOELAB_SUITE_TINY:-0}" = "1" ]; then
  # One process per script, so the CI pays JAX's start-up and the matmul compile once.
  RUNS=()
  for p in $MOE_PRESETS; do for b in $BACKENDS; do RUNS+=(--run "$p:$b"); done; done
  for p in $MOE_PRESETS; do RUNS+=(--run "$p-dense:dense"); done
  LAYER_SHAPE=(--tokens 256 --d 64 --experts 8 --topk 2 --width 32 --iters 2 --out "$OUT/moe_layer.json" --json)
  # In three parts, as on the GPU, so the merges are tested too.
  ("$PY" "$HERE/moe_layer.py" "${LAYER_SHAPE[@]}" --backends capacity,grouped --check --profile
   "$PY" "$HERE/moe_layer.py" "${LAYER_SHAPE[@]}" --merge --backends "" \
       --grouped-variants 16x32x16w4s3,16x32x16w4s3-rows-unfused --breakdown
   "$PY" "$HERE/moe_layer.py" "${LAYER_SHAPE[@]}" --merge --backends ep,dropless) > "$OUT/moe_layer.log" 2>&1 &
  LAYER=$!
  "$PY" "$HERE/mfu.py" --matmul-only --tiny --out-dir "$OUT" --json > "$OUT/matmul.log" 2>&1
  "$PY" "$HERE/mfu.py" --tiny "${RUNS[@]}" --steps 1 --windows 2 --warmup 0 --profile --out-dir "$OUT" --json \
      > "$OUT/mfu.log" 2>&1
  wait $LAYER
else
  # run SECONDS_CAP FILE NAME CMD...: the command under a timeout that also respects the suite's budget.
  run() {
    local cap=$1 file=$2 name=$3; shift 3
    local left=$((BUDGET_S - SECONDS - 5))
    # A file that already holds results (moe_layer.json before its --merge part) is never replaced by a stub.
    if [ "$left" -lt 20 ]; then [ -s "$file" ] || stub "$file" skipped "suite budget of ${BUDGET_S}s spent" "$name"; return; fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "gpu_suite: [${SECONDS}s] $name (timeout ${cap}s)" >&2
    timeout --kill-after=10 "$cap" "$@" >> "$OUT/suite.log" 2>&1
    local rc=$?
    if [ ! -s "$file" ]; then
      if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then stub "$file" timeout "killed after ${cap}s" "$name"
      else stub "$file" crashed "exit status $rc; see suite.log" "$name"; fi
    elif [ $rc -ne 0 ]; then
      echo "gpu_suite: $name ended with status $rc; its file keeps what it finished" >&2
    fi
  }
  run 60 "$OUT/matmul.json" matmul "$PY" "$HERE/mfu.py" --matmul-only --out-dir "$OUT" --json
  mfu_run() {  # PRESET:BACKEND [--profile]
    local p=${1%%:*} b=${1##*:} cap=90
    [[ $p == gpu-medium* ]] && cap=120  # compile + state init + ~15 s timed
    run $cap "$OUT/mfu_${p}_${b}.json" mfu "$PY" "$HERE/mfu.py" --run "$p:$b" --out-dir "$OUT" \
        --steps 5 --windows 3 --warmup 2 --budget-s 15 --json "${@:2}"
  }
  # The issue's figures first: the layer on the two fast paths (checked against each other), then
  # gpu-medium's MFU against its dense counterpart; the extras after, so a tight budget cuts only them.
  # Each also traces two calls: where the device time goes, by kernel (profile_summary.py).
  run 100 "$OUT/moe_layer.json" moe_layer "$PY" "$HERE/moe_layer.py" --backends capacity,grouped --check \
      --profile --budget-s 3 --out "$OUT/moe_layer.json" --json
  for pb in gpu-medium:grouped gpu-medium:capacity gpu-medium-dense:dense; do mfu_run $pb --profile; done
  # The tile variants and the breakdown say where grouped's time goes; ep and dropless (ragged_dot's
  # slow dense fallback) come after them, so a cap cuts the least informative first.
  run 150 "$OUT/moe_layer.json" moe_layer_variants "$PY" "$HERE/moe_layer.py" --merge --backends "" \
      --grouped-variants default --breakdown --budget-s 2 --out "$OUT/moe_layer.json" --json
  run 90 "$OUT/moe_layer.json" moe_layer_ep_dropless "$PY" "$HERE/moe_layer.py" --merge --backends ep,dropless \
      --budget-s 2 --out "$OUT/moe_layer.json" --json
  for pb in gpu-small:grouped gpu-small:capacity gpu-small-dense:dense \
            gpu-medium:ep gpu-small:ep gpu-medium:dropless gpu-small:dropless; do mfu_run $pb; done
fi
"$PY" "$HERE/suite_table.py" "$OUT" --record "$OUT/record.json"
