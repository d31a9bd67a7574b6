# The operator image: dlo_operator plus the worker's torch-free configuration code.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t dlo-operator .
# BASE_IMAGE: any Debian-based image with Python 3.11 and pip on PATH (the local test
# cluster builds one with debootstrap; see tests/cluster/images.py).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /opt/diffusion-dlo
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY operator ./operator
# The pip cache mount keeps downloaded wheels between builds, outside the image.
RUN --mount=type=cache,target=/root/.cache/pip pip install ".[operator]"
USER 65532:65532
ENTRYPOINT ["dlo-operator"]
