#!/usr/bin/env bash
# Verify conversions of a synthetic pair with the REAL 31B geometry (full widths, full vocab; fewer target layers)
# on one GPU, in well under 10 minutes on an H200. Writes the verify reports and timings into REPORT_DIR.
#
#   scripts/gpu_verify.sh REPORT_DIR              # defaults: 12 target layers, --device cuda
#   LAYERS=6 DEVICE=cpu scripts/gpu_verify.sh R   # the same on CPU (how the README's CPU timings were taken)
#
# Env: LAYERS (target decoder layers, real pattern truncated), DEVICE (cuda|cpu|auto), WIDTH_DIVISOR (1 = real
# widths), WORK (scratch dir, default a new temp dir, removed at the end), PY (python with this package installed).
set -euo pipefail
REPORT_DIR=${1:?usage: scripts/gpu_verify.sh REPORT_DIR}
LAYERS=${LAYERS:-12}
DEVICE=${DEVICE:-cuda}
WIDTH_DIVISOR=${WIDTH_DIVISOR:-1}
PY=${PY:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$REPORT_DIR"
REPORT_DIR=$(cd "$REPORT_DIR" && pwd)
WORK=${WORK:-$(mktemp -d)}
trap 'rm -rf "$WORK"' EXIT
CLI=("$PY" -m converter.cli)
timings="$REPORT_DIR/timings.txt"
: >"$timings"
step() {  # step NAME COMMAND...: run, append wall seconds to timings.txt
  local name=$1; shift
  local start=$SECONDS
  "$@"
  echo "$name $((SECONDS - start)) s" | tee -a "$timings"
}
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu",
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' | tee -a "$timings"
step synthesize "$PY" scripts/make_synthetic.py --preset 31b --num-layers "$LAYERS" --width-divisor "$WIDTH_DIVISOR" \
  --num-shards 4 --out "$WORK/src"
for layout in per-layer pad-global; do
  step "convert-$layout" "${CLI[@]}" convert --target "$WORK/src/target" --assistant "$WORK/src/assistant" \
    --out "$WORK/$layout" --layout "$layout"
done
for run in "pad-global bf16" "pad-global fp32" "per-layer bf16"; do
  set -- $run
  step "verify-$1-$2" "${CLI[@]}" verify --target "$WORK/src/target" --assistant "$WORK/src/assistant" \
    --converted "$WORK/$1" --device "$DEVICE" --dtype "$2" --json "$REPORT_DIR/verify-$1-$2.json" \
    | tee "$REPORT_DIR/verify-$1-$2.txt"
done
