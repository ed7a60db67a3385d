#!/usr/bin/env bash
# The engine check (scripts/consumers/vllm/serve_check.py) on a GPU with the CUDA `vllm==0.27.0` wheel, on a pair
# with the FULL real 31B geometry (hidden 5376, 32 heads, head_dim 256/512, 16/4 KV heads, vocab 262144)
# and 6 decoder layers (one sliding period + the full layer), bf16 weights, both layouts. Run twice: with
# vLLM's own backend choice and with `--attention-backend TRITON_ATTN` (what `convert` prints for
# pad-global). Records per run: the attention backend vLLM logs per layout, tokens/s, draft acceptance
# (random draft weights: expect ~0, compare drafts not rates), and the verdicts.
#
# usage: scripts/gpu_serve_check.sh [WORKDIR]      (default /tmp/gemma4-gpu-serve; ~30 GB of disk)
# needs: one NVIDIA GPU (>= 40 GB), python3.10-3.14, the package index. Planned to finish in < 10 min on
# an H200 with 16 cores: env ~3 min (pip), pair + 2 conversions ~2 min, 2 x 5 engines ~4 min.
# out:   WORKDIR/report-default.json, WORKDIR/report-triton.json, WORKDIR/summary.txt; exit 1 if a verdict fails.
# STATUS: prepared, NOT yet run (no GPU was lent to the task that wrote it; README "Proof").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
W="${1:-/tmp/gemma4-gpu-serve}"
mkdir -p "$W"
say() { echo "gpu_serve_check: $*" >&2; }
command -v nvidia-smi >/dev/null && nvidia-smi -L >&2 || { say "FAILED no NVIDIA GPU visible (nvidia-smi)"; exit 2; }

T0=$SECONDS
if [ ! -x "$W/venv/bin/vllm" ]; then
  say "env: vllm==0.27.0 (CUDA wheel, its own requirements) + transformers 5.14.1 + this project"
  python3 -m venv "$W/venv"
  "$W/venv/bin/pip" install -q "vllm==0.27.0" -r "$ROOT/scripts/consumers/vllm/requirements-transformers-5.14.1.txt"
  "$W/venv/bin/pip" install -q -e "$ROOT"
fi
PY="$W/venv/bin/python"
say "env ready after $((SECONDS - T0)) s: $("$PY" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"

if [ ! -f "$W/pair/original/assistant/config.json" ]; then
  rm -rf "$W/pair"
  "$PY" "$ROOT/scripts/make_synthetic.py" --preset 31b --num-layers 6 --text-only --dtype bf16 --out "$W/pair/original"
  # non-degenerate greedy output (matrix.synthetic.ENGINE_SCALES; the layouts touch neither tensor)
  PYTHONPATH="$ROOT/scripts" "$PY" -c 'import sys; from matrix.synthetic import scale_for_engine; scale_for_engine(sys.argv[1])' "$W/pair/original/target"
  for layout in pad-global per-layer; do
    "$W/venv/bin/gemma4-convert" convert --target "$W/pair/original/target" --assistant "$W/pair/original/assistant" \
      --out "$W/pair/$layout" --layout "$layout" | tee "$W/convert-$layout.txt"
  done
fi
say "pair + conversions ready after $((SECONDS - T0)) s"

rc=0
for variant in default triton; do
  extra=()
  [ "$variant" = triton ] && extra=(--attention-backend TRITON_ATTN)
  "$PY" "$ROOT/scripts/consumers/vllm/serve_check.py" --ref-target "$W/pair/original/target" \
    --ref-assistant "$W/pair/original/assistant" \
    --target "$W/pair/pad-global/target" --assistant "$W/pair/pad-global/assistant" \
    --target "$W/pair/per-layer/target" --assistant "$W/pair/per-layer/assistant" \
    --python "$PY" --dtype bfloat16 --workdir "$W/work-$variant" --json "$W/report-$variant.json" "${extra[@]}" \
    | tee "$W/table-$variant.txt" || rc=1
  say "$variant done after $((SECONDS - T0)) s"
done
"$PY" - "$W" > "$W/summary.txt" <<'PYEOF'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
for variant in ("default", "triton"):
    report = json.loads((w / f"report-{variant}.json").read_text())
    for env, runs in report["runs"].items():
        for label, run in runs.items():
            print(f"{variant:8s} {label:28s} ok={run['ok']} tokens/s={run.get('tokens_per_s')} "
                  f"acceptance={run.get('acceptance')} start_s={run['seconds'].get('engine_start')} "
                  f"backends={' | '.join(run.get('backends', []))} {run.get('error') or ''}")
    for v in report["verdicts"]:
        print(f"{variant:8s} verdict {v['pair']:12s} {v['dtype']:9s} {'PASS' if v['passed'] else 'FAIL ' + '; '.join(v['reasons'])}")
PYEOF
cat "$W/summary.txt"
say "total $((SECONDS - T0)) s; exit $rc"
exit $rc
