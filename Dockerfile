# syntax=docker/dockerfile:1
#
# chattts-stream container images: one Dockerfile, two targets on one base.
#
#   docker build --target gpu -t chattts-stream:gpu .                  # NVIDIA GPU (CUDA 13 torch)
#   docker build --target cpu -t chattts-stream:cpu .                  # CPU, the compiled step (+ g++)
#
#   docker run --gpus all -p 8080:8080 -p 8081:8081 -p 10200:10200 -v chattts-models:/models chattts-stream:gpu
#   docker run -p 8080:8080 -p 8081:8081 -v chattts-models:/models chattts-stream:cpu --dev-model tiny
#
# The GPU image needs, on the host, an NVIDIA driver for CUDA 13 (580 or newer) and the NVIDIA
# Container Toolkit (`--gpus`), which mounts the driver into the container. A driver older
# than that: build with --build-arg TORCH_SPEC=torch==2.13.0+cu126 --build-arg
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 --build-arg NVIDIA_REQUIRE_CUDA="cuda>=12.0"
# (CUDA 12.6 runs on driver 525 or newer).
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
# Both images install exactly as the README does, with scripts/setup.sh (system
# libraries with apt, the virtual environment .venv in the source folder, torch from
# TORCH_SPEC and torchaudio of the same build, chattts-stream[model] and its Python client).
# Each image has a build stage, where setup.sh does the heavy Python install, and a
# final stage that copies that .venv and runs setup.sh once more: the Python part is
# skipped there (setup.sh's stamp matches) and only the apt step runs, so the final
# image holds the runtime libraries without apt lists or pip caches.
#
# The weights are NOT in the image: they go to the /models volume
# (CHATTTS_CACHE_DIR=/models; downloaded on first start), or mount a folder with the
# ChatTTS assets and pass --model-dir DIR. Every server flag is also a CHATTTS_*
# variable (`docker run IMAGE --help`).

# The base of every image: Debian bookworm's slim Python 3.11, pinned by digest (the Docker
# Official Image's multi-platform index, as docker-library/repo-info records it in
# repos/python/remote/3.11-slim-bookworm.md: Python 3.11.16, Debian of 2026-08-24).
# scripts/base_images.sh prints the command that gives the tag's current digest, to refresh it.
#
# Why not nvidia/cuda for the GPU: torch's CUDA wheel brings its own CUDA libraries (the
# nvidia-* wheels: cuBLAS, cuDNN, NCCL, ..., 2.7 GiB installed for torch 2.13's CUDA 13.0
# build) and loads them from the virtual environment, never from /usr/local/cuda. A CUDA
# "runtime" base would add a second copy (nvidia/cuda:12.8.1-runtime: CUDA 12 libraries,
# which a CUDA 13 torch cannot even load). The one thing torch needs from outside the wheel is
# the driver (libcuda), which the NVIDIA Container Toolkit mounts from the host. The sizes:
# bench/results/studies/image-content-gpu.md (python -m bench.studies.image_content).
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b

FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHON=python3 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/chattts-stream

# ---------------------------------------------------------------------------------
# Build stages: scripts/setup.sh as root (it installs apt packages and creates .venv).
# Only what the install reads is copied first, so a source change does not reinstall
# torch: setup.sh hashes its STAMP_INPUTS, and the editable installs of the `server` package
# and the client resolve to /opt/chattts-stream, which the final stage fills.
# TORCH_SPEC and TORCH_INDEX_URL are what scripts/torch_choice.sh picks on a machine without
# an NVIDIA driver (cpu) and on one with a CUDA 13 driver (gpu), given here rather than
# detected: the machine that builds an image is not the one that runs it. With no probe and no
# fallback, an index that cannot be reached fails the build instead of changing the image.
# ---------------------------------------------------------------------------------
FROM base AS cpu-build
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

FROM base AS gpu-build
# The CUDA 13.0 build, with its nvidia-* wheels (the CUDA libraries torch loads).
ARG TORCH_SPEC=torch==2.13.0+cu130
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
COPY pyproject.toml README.md ./
COPY scripts/setup.sh scripts/torch_choice.sh scripts/
COPY server/__init__.py server/py.typed server/
COPY client_py/pyproject.toml client_py/README.md client_py/LICENSE client_py/
COPY client_py/src/chattts_stream_client/__init__.py client_py/src/chattts_stream_client/py.typed client_py/src/chattts_stream_client/
RUN --mount=type=cache,target=/root/.cache/uv \
    TORCH_SPEC="${TORCH_SPEC}" TORCH_INDEX="${TORCH_INDEX_URL}" UV_LINK_MODE=copy scripts/setup.sh \
    && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------
# Final images. cpu and gpu are kept identical except for the build stage they copy, their
# device, and the cpu image's C++ compiler.
# ---------------------------------------------------------------------------------
FROM base AS cpu
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
# The server's default CPU step (--profile realtime) is compiled: inductor builds the token
# step's kernels with a C++ compiler, and the step's C++ operators (attention; the w8a8 products
# on AVX512-VNNI: server/engine/chattts/step/csrc) are built with ninja from the venv against the base's
# Python headers. Without g++ the server would step eagerly (TOKEN STEP FALLBACK). The server
# keeps both in its cache dir, /models/compiled (the weights volume), keyed by torch, CPU,
# model and step form, so a restart reuses what was compiled (minutes on two cores the first
# time); `docker run ... chattts-stream:cpu compile` builds it ahead (docs/operations.md).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/chattts-stream/.venv/bin:${PATH} \
    HOME=/home/app \
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

FROM base AS gpu
ARG TORCH_SPEC=torch==2.13.0+cu130
# The CUDA version the torch build needs from the host's driver (CUDA 13.0: driver 580 or
# newer; a driver for any 13.x runs it). The NVIDIA Container Toolkit checks it when the
# container starts and refuses an older driver with a message that says so, instead of a
# server that finds no GPU. cu126 builds: cuda>=12.0 (minor version compatibility).
ARG NVIDIA_REQUIRE_CUDA="cuda>=13.0"
# A fixed numeric uid/gid: Kubernetes runAsNonRoot can verify it (a user name it cannot).
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app app \
    && install -d -o app -g app -m 0750 /models
COPY --from=gpu-build /opt/chattts-stream/.venv .venv
COPY . .
# Same command as the README; the Python part is already done (matching stamp), so this
# installs the system libraries (libopus0) in this image.
RUN TORCH_SPEC="${TORCH_SPEC}" scripts/setup.sh && rm -rf /var/lib/apt/lists/*
# NVIDIA_*: what the NVIDIA Container Toolkit reads (nvidia/cuda images set the same): every
# GPU the runtime grants, the driver's compute libraries and nvidia-smi, and the requirement.
ENV PATH=/opt/chattts-stream/.venv/bin:${PATH} \
    HOME=/home/app \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA=${NVIDIA_REQUIRE_CUDA} \
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
