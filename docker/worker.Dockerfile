# The worker image. PyPI's torch wheels carry their CUDA libraries; the node provides the
# driver (NVIDIA container toolkit). Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t dlo-worker .
# BASE_IMAGE: any Debian-based image with Python 3.11 and pip on PATH (the local test
# cluster builds one with debootstrap; see tests/harness/images.py).
ARG BASE_IMAGE=python:3.11-slim

# Build stage: the wheel, with the native staging ring compiled (a C compiler lives here
# only). The build fails rather than ship a worker that falls back to block buffers.
FROM ${BASE_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY worker ./worker
COPY operator ./operator
RUN --mount=type=cache,target=/root/.cache/pip pip wheel --no-deps --wheel-dir /wheels .
RUN python3 -c "import glob, zipfile; \
names = zipfile.ZipFile(glob.glob('/wheels/*.whl')[0]).namelist(); \
assert any('_staging_ring' in name and name.endswith('.so') for name in names), \
'the native staging ring was not built: see the compiler output above'"

# Runtime stage: the wheel, its dependencies, and what torch compiles kernels with while
# the worker runs: inductor builds C++ for `--compile` on the CPU and Triton builds its CUDA
# launcher on a GPU, each with g++/gcc and the Python headers. Without them `--compile`
# fails on its first step (PyTorch's own runtime images lacked them: pytorch#116696).
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && headers='import os, sys, sysconfig; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
 && if ! python3 -c "$headers"; then apt-get install -y --no-install-recommends python3-dev; fi \
 && python3 -c "$headers" \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /tmp/wheels
# The pip cache mount keeps downloaded wheels between builds, outside the image.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install "$(ls /tmp/wheels/*.whl)[worker]" && rm -rf /tmp/wheels
# A non-root user (the operator renders runAsUser 65532 and mounts an emptyDir on $HOME,
# since the root filesystem is read-only in its Pods).
RUN groupadd --gid 65532 dlo \
 && useradd --uid 65532 --gid 65532 --home-dir /home/dlo --create-home --shell /usr/sbin/nologin dlo
ENV HOME=/home/dlo
USER 65532:65532
# The operator overrides the command with torchrun for multi-rank Pods; a single rank
# runs the entrypoint directly.
ENTRYPOINT ["dlo-worker", "serve"]
