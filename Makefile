# gemma4-convert: `make install` then `make test`; `make demo` runs the main job on a synthetic pair.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO ?= demo

.PHONY: install test demo clean

install:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a CPU machine takes the local 2.13.0 CPU wheel instead of a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'

test:
	$(PY) -m pytest -q

demo:
	rm -rf $(DEMO)
	$(PY) scripts/make_synthetic.py --preset 31b --tiny --num-shards 2 --out $(DEMO)/source
	$(VENV)/bin/gemma4-convert inspect $(DEMO)/source/target
	$(VENV)/bin/gemma4-convert convert --target $(DEMO)/source/target --assistant $(DEMO)/source/assistant \
		--out $(DEMO)/per-layer --layout per-layer
	$(VENV)/bin/gemma4-convert convert --target $(DEMO)/source/target --assistant $(DEMO)/source/assistant \
		--out $(DEMO)/pad-global --layout pad-global
	$(VENV)/bin/gemma4-convert check-pair $(DEMO)/pad-global/target $(DEMO)/pad-global/assistant
	$(VENV)/bin/gemma4-convert verify --target $(DEMO)/source/target --assistant $(DEMO)/source/assistant \
		--converted $(DEMO)/pad-global

clean:
	rm -rf $(DEMO) build *.egg-info .pytest_cache
