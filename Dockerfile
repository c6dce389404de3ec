# syntax=docker/dockerfile:1
#
# chattts-stream container images: one Dockerfile, two targets.
#
#   docker build --target gpu -t chattts-stream:gpu .   # NVIDIA GPU (CUDA torch wheel)
#   docker build --target cpu -t chattts-stream:cpu .   # CPU only (small CPU torch wheel)
#
#   docker run --gpus all -p 8080:8080 -p 8081:8081 -p 10200:10200 -v chattts-models:/models chattts-stream:gpu
#   docker run -p 8080:8080 -p 8081:8081 -v chattts-models:/models chattts-stream:cpu --dev-model tiny
#
# Ports: 8080 = WebSocket /v1/stream, /health, /ready, /metrics and the demo page;
# 8081 = the OpenAI-compatible HTTP API (/v1/audio/speech, /v1/models, /v1/audio/voices);
# 10200 = Wyoming for Home Assistant (the port Home Assistant's Wyoming integration expects
# for TTS). Wyoming has no API keys: with CHATTTS_API_KEYS set the server refuses to open it
# on 0.0.0.0 unless CHATTTS_WYOMING_ALLOW_UNAUTHENTICATED=true says a firewall guards it
# (or CHATTTS_WYOMING_PORT=0 turns it off).
# CHATTTS_HTTP_PORT is set explicitly: with an explicit port a bind failure stops the
# server, where the default (-1 = port + 1) would only log a warning and run without it.
#
# Both targets install exactly as the README does, with scripts/setup.sh (system
# libraries with apt, the virtual environment .venv in the source folder, torch from
# TORCH_SPEC and torchaudio of the same build, chattts-stream[model] and its Python client).
# Each target has a build stage, where setup.sh does the heavy Python install, and a
# final stage that copies that .venv and runs setup.sh once more: the Python part is
# skipped there (setup.sh's stamp matches) and only the apt step runs, so the final
# image holds the runtime libraries without apt lists or pip caches.
#
# The weights are NOT in the image: they go to the /models volume
# (CHATTTS_CACHE_DIR=/models; downloaded on first start), or mount a folder with the
# ChatTTS assets and pass --model-dir DIR. Every server flag is also a CHATTTS_*
# variable (`docker run IMAGE --help`).

# Base images. GPU: the CUDA runtime of the same major version as the torch wheel
# (PyPI's default Linux torch wheels are CUDA 12 builds and bring their own CUDA
# libraries; the host driver must support that CUDA version).
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm
ARG GPU_BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

# ---------------------------------------------------------------------------------
# Bases: Python 3.11 on each; everything after this is the same for both targets.
# ---------------------------------------------------------------------------------
FROM ${CPU_BASE_IMAGE} AS cpu-base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHON=python3 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/chattts-stream

FROM ${GPU_BASE_IMAGE} AS gpu-base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu 22.04's own python3.11 (universe); versions follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV PYTHON=python3.11 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /opt/chattts-stream

# ---------------------------------------------------------------------------------
# Build stages: scripts/setup.sh as root (it installs apt packages and creates .venv).
# Only what the install reads is copied first, so a source change does not reinstall
# torch: setup.sh hashes its STAMP_INPUTS, and the editable installs of the `server` package
# and the client resolve to /opt/chattts-stream, which the final stage fills.
# ---------------------------------------------------------------------------------
FROM cpu-base AS cpu-build
# The CPU wheel (about 200 MB instead of several GB of CUDA libraries).
ARG TORCH_SPEC=torch==2.13.0+cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY scripts/setup.sh scripts/torch_choice.sh scripts/
COPY server/__init__.py server/py.typed server/
COPY client_py/pyproject.toml client_py/README.md client_py/LICENSE client_py/
COPY client_py/src/chattts_stream_client/__init__.py client_py/src/chattts_stream_client/py.typed client_py/src/chattts_stream_client/
RUN --mount=type=cache,target=/root/.cache/uv \
    TORCH_SPEC="${TORCH_SPEC}" TORCH_INDEX="${TORCH_INDEX_URL}" UV_LINK_MODE=copy scripts/setup.sh \
    && rm -rf /var/lib/apt/lists/*

FROM gpu-base AS gpu-build
# PyPI's default Linux wheel: the CUDA 13.0 build (see the README on TORCH_SPEC).
ARG TORCH_SPEC=torch==2.13.0
COPY pyproject.toml README.md ./
COPY scripts/setup.sh scripts/torch_choice.sh scripts/
COPY server/__init__.py server/py.typed server/
COPY client_py/pyproject.toml client_py/README.md client_py/LICENSE client_py/
COPY client_py/src/chattts_stream_client/__init__.py client_py/src/chattts_stream_client/py.typed client_py/src/chattts_stream_client/
RUN --mount=type=cache,target=/root/.cache/uv \
    TORCH_SPEC="${TORCH_SPEC}" UV_LINK_MODE=copy scripts/setup.sh \
    && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------
# Final images. Kept identical except for FROM and the build stage they copy.
# ---------------------------------------------------------------------------------
FROM cpu-base AS cpu
ARG TORCH_SPEC=torch==2.13.0+cpu
# A fixed numeric uid/gid: Kubernetes runAsNonRoot can verify it (a user name it cannot).
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app app \
    && install -d -o app -g app -m 0750 /models
COPY --from=cpu-build /opt/chattts-stream/.venv .venv
COPY . .
# Same command as the README; the Python part is already done (matching stamp), so this
# installs the system libraries (libopus0) in this image.
RUN TORCH_SPEC="${TORCH_SPEC}" scripts/setup.sh && rm -rf /var/lib/apt/lists/*
# `--compile-step on` (CHATTTS_COMPILE_STEP=on) compiles the CPU token step with inductor,
# which builds its kernels with a C++ compiler: without g++ the server would step eagerly.
# It also builds the step's C++ attention (server/engine/chattts/step/csrc, with ninja from
# the venv). Both caches go on the weights volume, so a restart reuses what was compiled.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/chattts-stream/.venv/bin:${PATH} \
    HOME=/home/app \
    TORCHINDUCTOR_CACHE_DIR=/models/inductor \
    TORCH_EXTENSIONS_DIR=/models/torch_extensions \
    CHATTTS_HOST=0.0.0.0 \
    CHATTTS_PORT=8080 \
    CHATTTS_HTTP_PORT=8081 \
    CHATTTS_WYOMING_PORT=10200 \
    CHATTTS_CACHE_DIR=/models \
    CHATTTS_DEVICE=cpu
VOLUME ["/models"]
EXPOSE 8080 8081 10200
USER 10001:10001
STOPSIGNAL SIGTERM
# Liveness: /health (200 while the inference loop runs). Model load (and the first
# download into /models) happens before the port listens, hence the long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CHATTTS_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["chattts-stream", "serve"]
CMD []

FROM gpu-base AS gpu
ARG TORCH_SPEC=torch==2.13.0
# A fixed numeric uid/gid: Kubernetes runAsNonRoot can verify it (a user name it cannot).
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app app \
    && install -d -o app -g app -m 0750 /models
COPY --from=gpu-build /opt/chattts-stream/.venv .venv
COPY . .
# Same command as the README; the Python part is already done (matching stamp), so this
# installs the system libraries (libopus0) in this image.
RUN TORCH_SPEC="${TORCH_SPEC}" scripts/setup.sh && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/chattts-stream/.venv/bin:${PATH} \
    HOME=/home/app \
    CHATTTS_HOST=0.0.0.0 \
    CHATTTS_PORT=8080 \
    CHATTTS_HTTP_PORT=8081 \
    CHATTTS_WYOMING_PORT=10200 \
    CHATTTS_CACHE_DIR=/models \
    CHATTTS_DEVICE=cuda
VOLUME ["/models"]
EXPOSE 8080 8081 10200
USER 10001:10001
STOPSIGNAL SIGTERM
# Liveness: /health (200 while the inference loop runs). Model load (and the first
# download into /models) happens before the port listens, hence the long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CHATTTS_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["chattts-stream", "serve"]
CMD []
