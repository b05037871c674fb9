#!/usr/bin/env bash
# SGLang + the FairShare plugin on an operator's GPU node: a two-tenant overload run with the plugin
# off and on, per-tenant service, share, throughput and TTFT printed side by side.
#
#   bash deploy/gpu/sglang-check.sh [--model DIR] [--duration 60] [--modes off,vtc] [...]
#
# Needs Python with sglang==0.5.23 (and its CUDA stack), grpcio/protobuf and tokenizers (FairShare's
# request translation is reused); nothing is downloaded: by default the model is a ~0.85B Llama
# config served with SGLang's dummy (random) weights. FairShare need not be pip-installed: the
# script makes the plugin's `sglang.srt.plugins` entry point visible through PYTHONPATH.
# Takes about 2 x (warmup + duration + engine start) seconds. Environment: PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sglang, torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "sglang-check: needs sglang and torch with a CUDA device ($PYTHON)" >&2
  exit 2
fi
"$PYTHON" -c 'import sglang, torch; print("sglang-check:", torch.cuda.get_device_name(), "| sglang", sglang.__version__, "| torch", torch.__version__)'
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" deploy/gpu/sglang_check.py "$@"
