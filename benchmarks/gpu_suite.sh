#!/usr/bin/env bash
# One-GPU benchmark suite (issue 9): bf16 matmul peak, the MoE layer alone (every backend, grouped's
# tile variants, a breakdown of where the time goes), then the train step of gpu-small and gpu-medium
# under capacity / grouped / ep (dropless on CPU only) and their equal-FLOP dense counterparts, and (issue 53)
# FP8 beside bf16: the layer and both steps on capacity, and a short loss comparison (benchmarks/fp8_loss.py).
#
#   benchmarks/gpu_suite.sh OUTDIR                      # on an H200: ~8 minutes planned, capped at 9
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
BUDGET_S=${MOELAB_SUITE_BUDGET_S:-540}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export JAX_COMPILATION_CACHE_DIR=${MOELAB_JAX_CACHE:-/tmp/moelab_jax_cache}

MOE_PRESETS="gpu-small gpu-medium"
BACKENDS="capacity grouped ep dropless"  # dropless last: ragged_dot's GPU fallback is the slow one (architecture §6)

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
  for p in $MOE_PRESETS; do RUNS+=(--run "$p-dense:dense" --run "$p:capacity-fp8"); done
  LAYER_SHAPE=(--tokens 256 --d 64 --experts 8 --topk 2 --width 32 --iters 2 --out "$OUT/moe_layer.json" --json)
  # In three parts, as on the GPU, so the merges are tested too.
  ("$PY" "$HERE/moe_layer.py" "${LAYER_SHAPE[@]}" --backends capacity,grouped --check --profile
   "$PY" "$HERE/moe_layer.py" "${LAYER_SHAPE[@]}" --merge --backends "" \
       --grouped-variants 16x32x16w4s3,16x32x16w4s3-rows-unfused --breakdown
   "$PY" "$HERE/moe_layer.py" "${LAYER_SHAPE[@]}" --merge --backends ep,dropless,capacity-fp8) > "$OUT/moe_layer.log" 2>&1 &
  LAYER=$!
  "$PY" "$HERE/mfu.py" --matmul-only --tiny --out-dir "$OUT" --json > "$OUT/matmul.log" 2>&1
  "$PY" "$HERE/mfu.py" --tiny "${RUNS[@]}" --steps 1 --windows 2 --warmup 0 --profile --out-dir "$OUT" --json \
      > "$OUT/mfu.log" 2>&1
  "$PY" "$HERE/fp8_loss.py" --preset tiny --steps 2 --json-out "$OUT/fp8_loss.json" > "$OUT/fp8_loss.log" 2>&1
  wait $LAYER
else
  # run SECONDS_CAP "FILE..." NAME CMD...: the command under a timeout that also respects the suite's
  # budget; each FILE it was to write and did not gets a stub saying why.
  # The seconds the suite has run: bash's clock, or (tests) the number in the file MOELAB_SUITE_CLOCK names, so a
  # test of the budget does not depend on how fast its machine is.
  elapsed() { if [ -n "${MOELAB_SUITE_CLOCK:-}" ]; then cat "$MOELAB_SUITE_CLOCK"; else echo "$SECONDS"; fi; }
  run() {
    local cap=$1 files=$2 name=$3; shift 3
    local now; now=$(elapsed)
    local left=$((BUDGET_S - now - 5)) f
    # A file that already holds results (moe_layer.json before its --merge part) is never replaced by a stub.
    if [ "$left" -lt 20 ]; then
      for f in $files; do [ -s "$f" ] || stub "$f" skipped "suite budget of ${BUDGET_S}s spent" "$name"; done
      return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "gpu_suite: [${now}s] $name (timeout ${cap}s)" >&2
    timeout --kill-after=10 "$cap" "$@" >> "$OUT/suite.log" 2>&1
    local rc=$?
    for f in $files; do
      if [ ! -s "$f" ]; then
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then stub "$f" timeout "killed after ${cap}s" "$name"
        else stub "$f" crashed "exit status $rc; see suite.log" "$name"; fi
      fi
    done
    if [ $rc -ne 0 ]; then echo "gpu_suite: $name ended with status $rc; its files keep what it finished" >&2; fi
  }
  # mfu_runs CAP PRESET:BACKEND... [-- EXTRA...]: several train-step runs in one process (one JAX start-up,
  # one matmul peak); each run's file is written as it finishes.
  mfu_runs() {
    local cap=$1; shift
    local files="" args=() pb
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      pb=$1; shift
      files+=" $OUT/mfu_${pb%%:*}_${pb##*:}.json"; args+=(--run "$pb")
    done
    [ $# -gt 0 ] && shift
    run "$cap" "$files" mfu "$PY" "$HERE/mfu.py" "${args[@]}" --out-dir "$OUT" \
        --steps 5 --windows 3 --warmup 2 --budget-s 10 --json "$@"
  }
  # Measured on the H200 (2026-12-04): a train-step run takes 20-35 s (compile 6-15 s), the layer's first
  # part ~100 s (each backend compiles for ~28 s), a tile variant ~30 s. The issue's figures come first,
  # so a tight budget cuts only the extras.
  run 60 "$OUT/matmul.json" matmul "$PY" "$HERE/mfu.py" --matmul-only --out-dir "$OUT" --json
  mfu_runs 150 gpu-medium:grouped gpu-medium:capacity gpu-medium-dense:dense -- --profile
  mfu_runs 120 gpu-small:grouped gpu-small:capacity gpu-small-dense:dense
  run 130 "$OUT/moe_layer.json" moe_layer "$PY" "$HERE/moe_layer.py" --backends capacity,grouped --check \
      --profile --budget-s 3 --out "$OUT/moe_layer.json" --json
  mfu_runs 90 gpu-medium:ep gpu-small:ep
  # One tile variant (the fastest alternative of 2026-12-04's five) and the breakdown, then ep's layer.
  run 100 "$OUT/moe_layer.json" moe_layer_variants "$PY" "$HERE/moe_layer.py" --merge --backends "" \
      --grouped-variants 128x128x64w4s3-unfused --breakdown --budget-s 2 --out "$OUT/moe_layer.json" --json
  # Issue 53: FP8 beside bf16 (the layer and both train steps on capacity), and the loss they reach.
  run 60 "$OUT/moe_layer.json" moe_layer_fp8 "$PY" "$HERE/moe_layer.py" --merge --backends capacity-fp8 \
      --budget-s 2 --out "$OUT/moe_layer.json" --json
  mfu_runs 90 gpu-medium:capacity-fp8 gpu-small:capacity-fp8
  run 120 "$OUT/fp8_loss.json" fp8_loss "$PY" "$HERE/fp8_loss.py" --preset gpu-small --steps 150 \
      --json-out "$OUT/fp8_loss.json"
  run 60 "$OUT/moe_layer.json" moe_layer_ep "$PY" "$HERE/moe_layer.py" --merge --backends ep \
      --budget-s 2 --out "$OUT/moe_layer.json" --json
  # dropless (ragged_dot) is refused on a GPU (`make_dispatch`: its fallback asked for 112.5 GiB): grouped
  # is its fast path. Its files say so instead of an out-of-memory crash.
  for p in $MOE_PRESETS; do
    stub "$OUT/mfu_${p}_dropless.json" refused "dropless is refused on a GPU; grouped is the dropless fast path" mfu
  done
fi
"$PY" "$HERE/suite_table.py" "$OUT" --record "$OUT/record.json"
