# The two commands a newcomer runs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?=
# llama-cpp-python compiles llama.cpp from source: use both cores.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
# Without llamafile's tinyBLAS, batched logits equal one-token logits, so speculative answers are the target's own
# (README "Identical answers"). LLAMAFILE=ON trades that promise for faster CPU prefill and verification.
LLAMAFILE ?= OFF
# llama.cpp for the NVIDIA card this machine has (and a CUDA toolkit to build for it), else for the CPU:
# GPU=cuda or GPU=cpu forces either way, CUDA_ARCH=89 names the card's compute capability (src/spectune/accelerator.py).
GPU ?= auto
CUDA_ARCH ?=
ACCELERATOR = PYTHONPATH=src $(PY) -m spectune.accelerator --gpu '$(GPU)' --cuda-arch '$(CUDA_ARCH)' --llamafile $(LLAMAFILE)
LLAMA_CPP_PIN := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)

.PHONY: demo test test-fast lint install clean

LLAMA_CPP_SDIST := $(VENV)/llama-cpp-sdist
PATCHES := src/spectune/llama_cpp_patch.py $(wildcard src/spectune/llama_cpp_patches/*.patch)

# llama-cpp-python is built first, from its source distribution with spectune's patches applied to the llama.cpp
# inside (src/spectune/llama_cpp_patch.py: its version then reads 0.3.36+spectune.DIGEST), past pip's wheel cache: a
# cached wheel may carry other cmake flags or no patches. pip's output goes to the install log (its tail is shown if
# it fails): `make demo` prints the demo's story only.
$(VENV)/.installed: pyproject.toml $(PATCHES)
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(ACCELERATOR) --describe
	@echo "installing into $(VENV): llama.cpp compiles from source, 10 to 20 minutes on 2 cores (log: $(VENV)/install.log)"
	@{ $(ACCELERATOR) --describe && flags=$$($(ACCELERATOR)) && rm -rf $(LLAMA_CPP_SDIST) && mkdir -p $(LLAMA_CPP_SDIST)/src \
		&& $(PY) -m pip download $(PIP_FLAGS) --no-binary :all: --no-deps -d $(LLAMA_CPP_SDIST) '$(LLAMA_CPP_PIN)' \
		&& source=$$(PYTHONPATH=src $(PY) -m spectune.llama_cpp_patch $(LLAMA_CPP_SDIST)/*.tar.gz $(LLAMA_CPP_SDIST)/src) \
		&& CMAKE_ARGS="$$flags $(CMAKE_ARGS)" $(PY) -m pip install $(PIP_FLAGS) --no-cache-dir \
			--force-reinstall --no-deps "$$source" \
		&& rm -rf $(LLAMA_CPP_SDIST) && $(PY) -m pip install $(PIP_FLAGS) -e '.[dev]'; } \
		> $(VENV)/install.log 2>&1 || { tail -n 40 $(VENV)/install.log; exit 1; }
	@touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	@$(VENV)/bin/spectune demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# Tests run 1 thread each, in TEST_WORKERS processes (pytest-xdist), a file's tests in one of them: its fixtures are
# built once.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The edit-run loop: lint and every test that trains no model and builds no tool (under two minutes).
test-fast: lint
	$(PY) -m pytest -m "not slow"

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
