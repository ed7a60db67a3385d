#!/usr/bin/env bash
# Creates once, then reuses, the virtual environments in which scripts/vllm027_check.py runs the
# stock vLLM 0.27.0 loader on CPU: torch 2.13.0 (CPU wheel), vllm 0.27.0 (--no-deps, see
# scripts/vllm027-requirements.txt) and one transformers version each. They live outside the
# project's own venv, in a cache that survives between runs on the same machine.
#
# usage: scripts/vllm_envs.sh [VERSION ...]
#   VERSION  a transformers release, or "newest" = the newest 5.x the package index serves
#            (default: 5.14.1 newest)
# stdout   one python path per environment, in argument order (nothing else)
# stderr   progress; on failure ONE line "vllm_envs: FAILED ..." naming the env, the step, the
#          reason and the full build log, then exit 1
# env      GEMMA4_VLLM_ENVS         cache root (default ~/.cache/gemma4-convert/vllm-envs)
#          GEMMA4_VLLM_BASE_PYTHON  interpreter the venvs are made from (default python3)
#
# An environment is reused only when its stamp matches the requirement files and this script;
# anything else (a half-built folder, changed pins) is deleted and built again.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${GEMMA4_VLLM_ENVS:-$HOME/.cache/gemma4-convert/vllm-envs}"
BASE_PY="${GEMMA4_VLLM_BASE_PYTHON:-python3}"
VLLM_VERSION="0.27.0"
TORCH_VERSION="2.13.0"
COMMON_REQ="$HERE/vllm027-requirements.txt"
STAMP_NAME=".gemma4-vllm-env-complete"

say() { echo "vllm_envs: $*" >&2; }
fail() { say "FAILED $*"; exit 1; }

# One line: env, step, exit code, the log's last non-empty line, where the whole log is.
fail_step() {
  local name="$1" step="$2" rc="$3" log="$4" last
  last="$(grep -v '^[[:space:]]*$' "$log" 2>/dev/null | tail -n 1 | cut -c1-300)"
  fail "to build $name at step '$step' (exit $rc): ${last:-no output}; full log: $log"
}

newest_transformers() {
  "$BASE_PY" -m pip index versions transformers 2>/dev/null \
    | sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' \
    | grep -E '^5\.[0-9]+\.[0-9]+$' | head -n 1 || true
}

# Newest transformers of an already built env, for when the index cannot be asked.
newest_cached() {
  local d best=""
  for d in "$ROOT"/vllm-"$VLLM_VERSION"_transformers-5.*; do
    [ -f "$d/$STAMP_NAME" ] || continue
    best="$(printf '%s\n%s\n' "$best" "${d##*_transformers-}" | sed '/^$/d' | sort -V | tail -n 1)"
  done
  echo "${best%%_*}"
}

resolve_version() {
  local v="$1" found
  if [ "$v" != "newest" ]; then echo "$v"; return; fi
  found="$(newest_transformers)"
  if [ -z "$found" ]; then
    found="$(newest_cached)"
    [ -n "$found" ] || fail "to resolve 'newest': 'pip index versions transformers' listed no 5.x release and no env is cached"
    say "cannot ask the package index for the newest transformers 5.x; using the newest cached env ($found)"
  fi
  echo "$found"
}

stamp_for() {
  local tf_req="$1"
  {
    echo "vllm=$VLLM_VERSION torch=$TORCH_VERSION python=$("$BASE_PY" -c 'import sys; print(sys.version.split()[0])')"
    cat "$COMMON_REQ" "$tf_req" "${BASH_SOURCE[0]}"
  } | sha256sum | cut -d' ' -f1
}

# Refuses to let pip fetch a CUDA torch (a multi-GB download that cannot work here anyway).
check_torch_source() {
  local py="$1" cons="$2"
  "$py" -m pip install -q --dry-run --no-deps --ignore-installed --report - -c "$cons" \
      "torch==$TORCH_VERSION" 2>/dev/null \
    | "$py" -c '
import json, sys
item = json.load(sys.stdin)["install"][0]
version, url = item["metadata"]["version"], item["download_info"]["url"]
if "+cpu" not in version and not url.startswith("file:"):
    sys.exit(f"torch {version} would come from {url}, not a local CPU wheel")
print(f"torch {version} from {url}")'
}

build_env() {
  local dir="$1" version="$2" tf_req="$3" log="$4" name="${1##*/}" py="$1/bin/python" cons="$1/constraints.txt"
  rm -rf "$dir"
  mkdir -p "$ROOT"
  : > "$log"
  say "building $name (log: $log)"
  "$BASE_PY" -m venv "$dir" >>"$log" 2>&1 || fail_step "$name" "python -m venv" $? "$log"
  echo "torch==$TORCH_VERSION" > "$cons"
  check_torch_source "$py" "$cons" >>"$log" 2>&1 || fail_step "$name" "torch source check" $? "$log"
  "$py" -m pip install -q -c "$cons" "torch==$TORCH_VERSION" >>"$log" 2>&1 \
    || fail_step "$name" "pip install torch" $? "$log"
  "$py" -m pip install -q --no-deps "vllm==$VLLM_VERSION" >>"$log" 2>&1 \
    || fail_step "$name" "pip install vllm --no-deps" $? "$log"
  "$py" -m pip install -q -c "$cons" -r "$COMMON_REQ" -r "$tf_req" >>"$log" 2>&1 \
    || fail_step "$name" "pip install requirements + transformers==$version" $? "$log"
  # CUDA torchvision/torchaudio break `import transformers` beside a CPU torch (torchvision::nms).
  "$py" -m pip uninstall -q -y torchvision torchaudio >>"$log" 2>&1 || true
  "$py" - "$version" "$VLLM_VERSION" "$TORCH_VERSION" >>"$log" 2>&1 <<'EOF' || fail_step "$name" "verify versions" $? "$log"
import sys
from importlib.metadata import version
import torch, transformers, safetensors  # noqa: F401  (imports must work)
want_tf, want_vllm, want_torch = sys.argv[1:4]
got = {"transformers": version("transformers"), "vllm": version("vllm"), "torch": torch.__version__}
assert got["transformers"] == want_tf, got
assert got["vllm"] == want_vllm, got
assert got["torch"].split("+")[0] == want_torch and torch.version.cuda is None, got
print("verified", got)
EOF
  stamp_for "$tf_req" > "$dir/$STAMP_NAME"
}

ensure_env() {
  local version="$1" dir tf_req log start
  dir="$ROOT/vllm-${VLLM_VERSION}_transformers-${version}"
  log="$ROOT/vllm-${VLLM_VERSION}_transformers-${version}.build.log"
  tf_req="$HERE/vllm027-requirements-transformers-$version.txt"
  if [ ! -f "$tf_req" ]; then
    tf_req="$ROOT/transformers-$version.requirements.txt"
    mkdir -p "$ROOT"
    echo "transformers==$version" > "$tf_req"
  fi
  if [ -f "$dir/$STAMP_NAME" ] && [ "$(cat "$dir/$STAMP_NAME")" = "$(stamp_for "$tf_req")" ] \
      && "$dir/bin/python" -c 'import torch' >/dev/null 2>&1; then
    say "reusing $dir"
  else
    start=$SECONDS
    build_env "$dir" "$version" "$tf_req" "$log"
    say "built $dir in $((SECONDS - start)) s"
  fi
  echo "$dir/bin/python"
}

main() {
  local versions=("$@") v resolved
  [ ${#versions[@]} -gt 0 ] || versions=(5.14.1 newest)
  command -v "$BASE_PY" >/dev/null || fail "to start: base interpreter '$BASE_PY' not found"
  mkdir -p "$ROOT"
  exec 9>"$ROOT/.lock"
  flock 9  # one builder at a time per cache
  for v in "${versions[@]}"; do
    resolved="$(resolve_version "$v")"
    ensure_env "$resolved"
  done
}

main "$@"
