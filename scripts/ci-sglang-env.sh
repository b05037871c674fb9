#!/usr/bin/env bash
# Build the CPU-only SGLang test environment (.venv-sglang) used by tests/sglang.
#
#   bash scripts/ci-sglang-env.sh [VENV_DIR]      (default: .venv-sglang in the repo root)
#
# `pip install sglang` would pull a CUDA torch and several GB of CUDA wheels. Instead:
#   1. a fresh venv with the CPU torch 2.13.0 (a bare "torch" would be a CUDA build);
#   2. sglang==0.5.23 with --no-deps;
#   3. only the packages that sglang's scheduler, schedule-policy, radix-cache and engine modules
#      import at module level (SGLANG_LIGHT_DEPS below; checked by importing them at the end);
#   4. torchvision is NOT installed (its PyPI wheel is a CUDA build that breaks on CPU torch), so
#      transformers sees it as unavailable; sglang.srt.configs imports torchvision.transforms at
#      module level, so the tests (and the check below) serve it as an inert stand-in
#      (tests/sglang/cpu_sglang.py);
#   5. this project (-e, --no-deps: registers the `sglang.srt.plugins` entry point) and what its
#      worker code and the tests need.
# Idempotent: a stamp records a successful build; rerunning with an unchanged script is a no-op
# (only the editable install is refreshed when pyproject.toml changed, for its entry points).
# Exits non-zero when anything fails, so `make test-sglang` fails too: the SGLang tests never skip
# silently in CI.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-sglang}
PY=${PY:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
# Imported at module level by sglang.srt.{plugins,managers.schedule_batch,managers.schedule_policy,
# mem_cache.radix_cache} (first three lines: FACTS.md's list; triton, ipython, dill, sentencepiece,
# compressed-tensors, gguf and aiohttp each re-checked by removal; openai and partial-json-parser
# found missing) and by managers.scheduler / entrypoints.engine (last line). Pins follow sglang
# 0.5.23's own requirements.
SGLANG_LIGHT_DEPS=(
  numpy orjson psutil pybase64 requests packaging pillow starlette triton msgspec pydantic pyzmq
  tqdm ipython aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0" gguf "openai==2.8.0" partial-json-parser
  setproctitle einops uvicorn fastapi uvloop
)
# What FairShare's own modules (worker.scheduling, worker.sglang_plugin, worker.sglang_server,
# the generated gRPC stubs) and the tests import.
FAIRSHARE_DEPS=(
  "pydantic-settings>=2.2" "pyyaml>=6" "grpcio>=1.85.1,<2" "grpcio-health-checking>=1.85,<2"
  "protobuf>=6.31,<8" "tokenizers>=0.21" "jinja2>=3.1" "prometheus-client>=0.20" "safetensors>=0.4"
  "opentelemetry-api>=1.30,<2" "opentelemetry-sdk>=1.30,<2"
  "xgrammar==0.2.7"  # what sglang 0.5.23 pins; worker.engine.grammar: the reference engine's grammar refusals
  "pytest>=8" "pytest-timeout>=2.3" "pytest-asyncio>=0.23"
)

# The editable install of this tree writes fairshare.egg-info here, as .venv's does (`make test`
# runs this script while `make install` may run): one at a time.
editable() {
  mkdir -p build
  if command -v flock >/dev/null 2>&1; then flock build/.editable-install.lock "$@"; else "$@"; fi
}

stamp="$VENV/.fairshare-sglang-stamp"
project_stamp="$VENV/.fairshare-project-stamp"
want=$(sha256sum "$0" | cut -c1-16)
project=$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  if [ "$(cat "$project_stamp" 2>/dev/null)" != "$project" ]; then
    editable "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
    echo "$project" > "$project_stamp"
  fi
  echo "ci-sglang-env: $VENV is up to date"
  exit 0
fi

t0=$(date +%s)
say() { printf '[sglang-env %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }

rm -rf "$VENV"
$PY -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
say "venv created"
"${pip[@]}" "torch==$TORCH_VERSION"
say "torch $TORCH_VERSION installed"
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"
say "sglang $SGLANG_VERSION installed (no deps)"
# pip's resolver lists sglang's uninstalled CUDA requirements as conflicts here; that is expected.
"${pip[@]}" "${SGLANG_LIGHT_DEPS[@]}" "${FAIRSHARE_DEPS[@]}" 2>&1 \
  | grep -v -e "^sglang $SGLANG_VERSION requires" -e "dependency resolver does not currently" \
            -e "Location 'file:" || true
"$VENV/bin/python" -c "import sglang, triton, transformers" # the install above must have worked
say "light dependencies installed"
editable "${pip[@]}" --no-deps -e .
say "fairshare installed (editable, no deps)"

# torchvision must stay out: a CUDA wheel of it makes `import transformers` fail on CPU torch.
if "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchvision") is None)'; then
  echo "ci-sglang-env: torchvision got installed; remove it (its wheel breaks on CPU torch)" >&2
  exit 1
fi

"$VENV/bin/python" - <<'PYCHECK'
import importlib, sys, warnings
from importlib.metadata import entry_points
warnings.filterwarnings("ignore")
sys.path.insert(0, ".")
from tests.sglang import cpu_sglang
cpu_sglang.prepare()
mods = [
    "sglang.srt.plugins", "sglang.srt.plugins.hook_registry",
    "sglang.srt.managers.schedule_batch", "sglang.srt.managers.schedule_policy",
    "sglang.srt.mem_cache.radix_cache", "sglang.srt.managers.scheduler",
    "sglang.srt.entrypoints.engine", "worker.sglang_plugin", "worker.sglang_server",
]
for m in mods:
    importlib.import_module(m)
from sglang.srt.mem_cache.radix_cache import RadixCache
RadixCache.create_simulated()
eps = [ep.value for ep in entry_points(group="sglang.srt.plugins")]
assert "worker.sglang_plugin:register" in eps, f"fairshare plugin entry point missing: {eps}"
import sglang, torch
print(f"ci-sglang-env: sglang {sglang.__version__}, torch {torch.__version__}: imports ok, plugin entry point ok")
PYCHECK
echo "$want" > "$stamp"
echo "$project" > "$project_stamp"
say "done"
