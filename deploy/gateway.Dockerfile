# syntax=docker/dockerfile:1
# FairShare gateway: the OpenAI-compatible HTTP tier (FastAPI, Redis admission, gRPC to workers).
# Slim: the core package and the [gateway] extra only, no torch. Build from the repository root:
#   docker build -f deploy/gateway.Dockerfile -t fairshare/gateway:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/fairshare
ENV PATH=/opt/fairshare/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fairshare ./fairshare
COPY gateway ./gateway
# The project itself ("."): its dependency ranges are in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gateway]" \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 fairshare \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/fairshare --create-home \
       --shell /usr/sbin/nologin fairshare
COPY --from=build /opt/fairshare /opt/fairshare
COPY --chmod=0755 deploy/healthcheck.py /usr/local/bin/fairshare-healthcheck
ENV PATH=/opt/fairshare/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FAIRSHARE_HOST=0.0.0.0 \
    FAIRSHARE_PORT=8000
WORKDIR /var/lib/fairshare
USER 10001:10001
EXPOSE 8000
# Ready = Redis answers and at least one worker is SERVING (GET /readyz).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["fairshare-healthcheck", "http", "http://127.0.0.1:8000/readyz"]
ENTRYPOINT ["fairshare"]
CMD ["gateway"]
