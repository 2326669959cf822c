#!/usr/bin/env bash
# One prepared check of an accelerator, for the day one is lent (make accel-check; sized for
# <= 8 minutes on one H200 or one TPU host). Parts, one JSON each under
# experiments/results/<device>/ (<device>: the device kind, e.g. nvidia_h200):
#   attention.json          the attention kernels against the einsum reference (value, grads)
#   bench_accel_SIZE.json   train MFU, n_future 1 vs 4, bf16, 125m and 350m (bench_accel.py)
#   bench_decode.json       a small model trained here, decoded greedy and sampled, batch 1 and
#                           8, chain, tree and auto (bench_decode.py)
#   memory.json             the 350m n=4 train step's compiled peak against the device's own
#                           memory_stats() after running it
# then a summary against the ahead-of-time estimates (experiments/accel_check.py summary).
#
#   experiments/accel_check.sh [--dry_run] [--out DIR] [--python PY]
#
# --dry_run: tiny sizes (seconds each on a CPU; what was run end to end on this repository's
# 2-core CPU), written under runs/accel-check-dry/<device> unless --out says otherwise.
# A failing part is reported and the others still run; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT=""
PY="${PYTHON:-.venv/bin/python}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry_run) DRY=1 ;;
    --out) OUT="${2:?--out: needs a folder}"; shift ;;
    --python) PY="${2:?--python: needs an interpreter}"; shift ;;
    *) echo "error: accel_check.sh: unknown flag '$1', allowed: --dry_run, --out DIR, --python PY" >&2
       exit 2 ;;
  esac
  shift
done

DEVICE=$("$PY" -c "import jax; from experiments.accel_check import device_tag; print(device_tag(jax.devices()[0]))") || exit 2
if [ "$DRY" = 1 ]; then
  OUT="${OUT:-runs/accel-check-dry/$DEVICE}"
  SIZES="tiny"; MEM_SIZE="tiny"; SEQ=64; STEPS=2; TRAIN_STEPS=30
  TRAIN_CONFIG=configs/tiny.py; PROMPT=16; NEW=16; REPS=3; TREE="tree:2"  # tiny: 2 heads
  BENCH_EXTRA=(--steps 2 --warmup 1 --decode_reps 1)
else
  OUT="${OUT:-experiments/results/$DEVICE}"
  SIZES="125m 350m"; MEM_SIZE="350m"; SEQ=1024; STEPS=10; TRAIN_STEPS=300
  TRAIN_CONFIG=configs/default.py; PROMPT=64; NEW=64; REPS=3; TREE="tree:4,2,1"
  BENCH_EXTRA=(--batch auto --steps 10 --warmup 2 --decode_reps 2)
fi
mkdir -p "$OUT"
RUN="$OUT/run"
FAILED=()
part() {  # part NAME CMD...: runs it, timed, and remembers a failure
  local name="$1"; shift
  echo "== accel-check: $name" >&2
  local t0=$SECONDS
  if ! "$@"; then FAILED+=("$name"); fi
  echo "== accel-check: $name took $((SECONDS - t0)) s" >&2
}

part attention "$PY" -m experiments.accel_check attention --seq "$SEQ" --json "$OUT/attention.json"
for size in $SIZES; do
  part "train $size" "$PY" -m experiments.bench_accel --size "$size" --dtype bfloat16 \
    "${BENCH_EXTRA[@]}" --json "$OUT/bench_accel_$size.json"
done
part "train a model to decode" "$PY" -m mtp_jax.train --config "$TRAIN_CONFIG" --workdir "$RUN" \
  --config.train.steps="$TRAIN_STEPS" --config.train.checkpoint_every="$TRAIN_STEPS" \
  --config.train.eval_every="$TRAIN_STEPS"
part decode "$PY" -m experiments.bench_decode --workdir "$RUN" --batches 1,8 \
  --prompt_lens "$PROMPT" --max_new_tokens "$NEW" --temperature 0.8 --top_p 1.0 \
  --variants "chain:all $TREE auto" --reps "$REPS" --json "$OUT/bench_decode.json"
part memory "$PY" -m experiments.accel_check memory --size "$MEM_SIZE" --json "$OUT/memory.json"
"$PY" -m experiments.accel_check summary --dir "$OUT"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "accel-check: FAILED: ${FAILED[*]}" >&2
  exit 1
fi
echo "accel-check: every part ran; JSONs in $OUT" >&2
