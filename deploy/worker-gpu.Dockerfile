# syntax=docker/dockerfile:1
# FairShare worker on NVIDIA GPUs: SGLang (from its official image) with the FairShare plugin.
# The project is installed into the image's Python with the reference-engine dependencies; the
# [sglang] extra is SGLang itself, which the base image already has, so it is not reinstalled:
# SGLang, torch and the CUDA stack of the base image are pinned as constraints.
# Build from the repository root (the base tag is a build argument):
#   docker build -f deploy/worker-gpu.Dockerfile --build-arg SGLANG_IMAGE=lmsysorg/sglang:v0.5.23 \
#     -t fairshare/worker-gpu:0.1.0 .
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23

FROM ${SGLANG_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/fairshare/src
COPY pyproject.toml README.md ./
COPY fairshare ./fairshare
COPY worker ./worker
RUN python3 -c "import sglang; print('base image SGLang', sglang.__version__)" \
    && python3 -m pip list --format=freeze \
       | grep -iE '^(sglang|sgl[-_]kernel|torch|torchvision|torchaudio|triton|transformers|flashinfer[-_a-z0-9]*|xgrammar|nvidia[-_][a-z0-9_-]+)==' \
       > /tmp/base-constraints.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/base-constraints.txt ".[worker]" \
    && python3 -c "import sglang, torch, fairshare, worker" \
    && rm -rf /tmp/base-constraints.txt build
RUN groupadd --system --gid 10001 fairshare \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/cache/fairshare --create-home \
       --shell /usr/sbin/nologin fairshare
COPY --chmod=0755 deploy/healthcheck.py /usr/local/bin/fairshare-healthcheck
# Triton / FlashInfer JIT caches live under HOME.
ENV HOME=/var/cache/fairshare \
    FAIRSHARE_CACHE_DIR=/var/cache/fairshare
WORKDIR /var/cache/fairshare
USER 10001:10001
EXPOSE 50051
# grpc.health.v1 on the worker port; loading weights and capturing CUDA graphs takes minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["fairshare-healthcheck", "grpc", "127.0.0.1:50051", "fairshare.v1.Worker"]
ENTRYPOINT ["fairshare"]
# The model directory is mounted at /models (see docker-compose.yml and the Helm chart).
CMD ["worker", "--engine", "sglang", "--host", "0.0.0.0", "--port", "50051", "--model", "/models/model"]
