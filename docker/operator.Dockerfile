# The operator image: dlo_operator plus the worker's torch-free configuration code.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t dlo-operator .
FROM python:3.11-slim
WORKDIR /opt/diffusion-dlo
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY operator ./operator
RUN pip install --no-cache-dir ".[operator]" && rm -rf /root/.cache
USER 65532:65532
ENTRYPOINT ["dlo-operator"]
