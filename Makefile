# Two commands on a fresh machine (see README.md):
#   make run   - set up .venv and run the main job on the bundled default model (CPU)
#   make test  - set up .venv and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first, so the range in pyproject.toml resolves to it.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/splitserve generate "def fibonacci(n):" --max-tokens 64

test: $(STAMP)
	$(PY) -m pytest -q -n auto

bench: $(STAMP)
	$(PY) -m bench.throughput

clean:
	rm -rf $(VENV) build *.egg-info
