# The operator image: dlo_operator plus the worker's torch-free configuration code.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t dlo-operator .
# BASE_IMAGE: any Debian-based image with Python 3.11 and pip on PATH (the local test
# cluster builds one with debootstrap; see tests/harness/images.py).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /opt/diffusion-dlo
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY operator ./operator
# The pip cache mount keeps downloaded wheels between builds, outside the image.
RUN --mount=type=cache,target=/root/.cache/pip pip install ".[operator]"
# The non-root user the chart runs it as, with a passwd entry: kopf names the operator
# after its user (getpass), which fails for a uid unknown to the image.
RUN groupadd --gid 65532 dlo \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin dlo
USER 65532:65532
ENTRYPOINT ["dlo-operator"]
