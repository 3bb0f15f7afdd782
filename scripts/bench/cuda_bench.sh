#!/usr/bin/env bash
# dlm on MLX's CUDA backend: the test suite, dlm against mlx-vlm 0.7.10 at the released geometries (few
# layers) in bf16, 4-bit and float32 (full, then TF32), and the batched step. Not part of the suite.
#
#   DLM_MLX_BACKEND=cuda13 scripts/setup.sh      # .venv with dlm[cuda13,test]; mlx-vlm in .peer (docs/benchmarks.md)
#   PY=.venv/bin/python bash scripts/bench/cuda_bench.sh OUTDIR
#   # PEER=.peer (mlx-vlm), LAYERS=2, WORK=.bench, DEADLINE=seconds, STEPS="tests dg ..."
#
# Every step has a time limit and its own log under OUTDIR, so one that fails or hangs costs only
# itself; the JSON files hold the full numbers.
set -u
OUT=${1:-/tmp/dlm-cuda}
mkdir -p "$OUT"
PY=${PY:-python3}
PEER=${PEER:-.peer}
LAYERS=${LAYERS:-2}
WORK=${WORK:-.bench}
DEADLINE=${DEADLINE:-100000}  # seconds from the start: no step runs past it
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  (( limit > DEADLINE - SECONDS )) && limit=$((DEADLINE - SECONDS))
  (( limit < 10 )) && { echo "== $name: skipped, past the deadline"; return; }
  echo "== $name (limit ${limit} s): $*"
  timeout -s INT -k 15 "$limit" "$@" >"$OUT/$name.log" 2>&1  # INT: pytest still prints its summary
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: rc $rc, $((SECONDS - t0)) s"
}

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null
for name in ${STEPS:-tests dg llada2 batch batchprof pieces tf32}; do
  case $name in
  tests)  # the suite on the GPU: parity tolerances, bitwise batch = solo, CPU-only paths staying off
    step tests "${TESTS_LIMIT:-300}" "$PY" -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" -rfE tests ;;
  dg)
    step dg "${DG_LIMIT:-400}" "$PY" -m scripts.bench.runtime --sizes release --dtypes bf16 q4 f32 \
      --release-layers "$LAYERS" --canvases 2 --steps 32 --repeats 5 --full-steps --work "$WORK" --peer "$PEER" \
      --json "$OUT/dg.json" ;;
  llada2)
    step llada2 "${LLADA2_LIMIT:-300}" "$PY" -m scripts.bench.llada2 --sizes release --dtypes bf16 q4 f32 \
      --release-layers "$LAYERS" --steps 32 --max-tokens 128 --repeats 5 --work "$WORK" --peer "$PEER" \
      --json "$OUT/llada2.json" ;;
  batch)  # the shared step of 1, 4 and 8 requests (dlm-run serve --max-batch), and with merged GEMMs
    step batch "${BATCH_LIMIT:-240}" bash -c "for m in $WORK/release${LAYERS}L-bf16 $WORK/llada2-mini-release${LAYERS}L-bf16; do \
      for flag in '' --merged-rows; do echo \$m \$flag; $PY -m scripts.bench.batch --model \$m --sizes 1,4,8 --steps-only \$flag; done; done" ;;
  batchprof)  # the host side of a batched step of 4 (Python-visible overhead; GPU time sits under mx.eval)
    step batchprof "${BATCHPROF_LIMIT:-120}" "$PY" -m cProfile -s tottime -m scripts.bench.batch \
      --model "$WORK/release${LAYERS}L-bf16" --sizes 4 --steps-only --windows 3 ;;
  pieces)  # where a bf16 step's time goes (scripts/bench/step_pieces.py)
    step pieces "${PIECES_LIMIT:-120}" "$PY" -m scripts.bench.runtime --sizes release --dtypes bf16 --release-layers "$LAYERS" \
      --canvases 1 --steps 8 --repeats 1 --full-steps --pieces --work "$WORK" --peer "$PEER" ;;
  tf32)  # float32 as MLX runs it by default on GPUs (TF32 products; dlm sets MLX_ENABLE_TF32=0 unless asked)
    step tf32 "${TF32_LIMIT:-200}" env MLX_ENABLE_TF32=1 "$PY" -m scripts.bench.runtime --sizes release --dtypes f32 \
      --release-layers "$LAYERS" --canvases 2 --steps 32 --repeats 5 --full-steps --work "$WORK" --peer "$PEER" \
      --json "$OUT/dg_tf32.json" ;;
  esac
done
