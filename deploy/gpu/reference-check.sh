#!/usr/bin/env bash
# Reference engine on a GPU node: throughput at batch 1/16/64, two-tenant VTC vs FCFS service split,
# scheduler time per iteration — one prepared run that finishes within 8 minutes.
#
#   bash deploy/gpu/reference-check.sh [extra reference_check.py flags]
#
# Run in the repo root on a machine with Python, torch (CUDA build) and tokenizers; nothing is
# downloaded and nothing needs installing: the model is a randomly initialised ~0.85B-parameter
# Llama (hidden 2048, 16 layers, 32/8 heads, SwiGLU 5632, vocab 32000) built in process, run by
# worker.engine.engine.Engine + worker.engine.model_runner.ModelRunner in bf16 on cuda.
# Environment: PYTHON (default python3), REFERENCE_CHECK_TIMEOUT (seconds, default 470).
# The same Python part runs on CPU for tests: python deploy/gpu/reference_check.py --preset tiny --device cpu
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
LIMIT=${REFERENCE_CHECK_TIMEOUT:-470}

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "reference-check: needs torch with a CUDA device ($PYTHON)" >&2
  exit 2
fi
"$PYTHON" -c 'import torch; print("reference-check:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
timeout --signal=TERM --kill-after=10 "$LIMIT" "$PYTHON" deploy/gpu/reference_check.py --device cuda "$@"
echo "reference-check: wall $(( $(date +%s) - start )) s (limit ${LIMIT} s)"
