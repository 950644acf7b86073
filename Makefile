# gdn_packed: set-up, tests and benchmarks.
#   make venv    .venv (python3.11, --system-site-packages so a machine's CUDA torch is reused),
#                dependencies, editable install that compiles csrc/ into gdn_packed/_C (when nvcc exists)
#   make test    the whole pytest suite (what CI runs), a progress line per test module and before each
#                slow test, the 25 slowest tests at the end
#   make test-fast  the suite without the slow lanes (markers interpreter, aot, subprocess, megatron;
#                tests/conftest.py): the torch backend, the csrc/ host mirrors, packing, layers, bench
#   make test-aot  the full sm_90 AOT sweep of every Triton kernel variant (tests/test_sm90_aot.py with
#                GDN_PACKED_AOT=full; `make test` compiles a subset that reaches every launch config)
#   make bench   the microbenchmark CLI (python -m bench $(ARGS)); results in bench/results/local/
#                (ignored by git), ARGS="--help" lists the options
#   make gpu-check [DRY_RUN=1] [OUT=DIR]   tools/gpu_check.py: the prepared check for a lent GPU
#                (README "On a lent GPU"); DRY_RUN=1 runs it on a CPU (interpreter, tiny shapes)
#   make gpu-wheels   the wheels the GPU machine lacks (fla-core) into .whl/ (ignored by git)
#   make test-compat  side venvs in .compat/ (ignored) with triton 3.6.0 and torch 2.13.0 / 2.11.0
#                (COMPAT_TRITON, COMPAT_TORCH): the device tests (Triton interpreter) and the sm_90 AOT tests
# Knobs: PYTHON=python3.x, GDN_PACKED_NO_CUDA=1 (skip csrc/), GDN_PACKED_CUDA_ARCHS="80;90a", ARGS=...
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check
DEPS_STAMP := $(VENV)/.gdn_packed_deps
BUILD_STAMP := $(VENV)/.gdn_packed_build
BUILD_INPUTS := setup.py pyproject.toml CMakeLists.txt $(wildcard csrc/*)
NVCC := $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
# 1 when nvcc exists and GDN_PACKED_NO_CUDA does not switch the build off (setup.py's reading: any
# value but empty/0/false/no/off): `make test` (and so CI) then fails if gdn_packed._C was not built
NO_CUDA := $(filter-out 0 false False FALSE no No NO off Off OFF,$(GDN_PACKED_NO_CUDA))
REQUIRE_C := $(if $(and $(NVCC),$(if $(NO_CUDA),,1)),1,0)
ARGS ?=

.PHONY: venv test test-fast test-aot bench clean-build gpu-check gpu-wheels test-compat

venv: $(BUILD_STAMP)

$(VPY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

# dependencies: torch only when the venv cannot import one (a CUDA torch on a GPU machine is kept)
$(DEPS_STAMP): $(VPY) pyproject.toml Makefile
	@if $(VPY) -c "import torch" >/dev/null 2>&1; then \
	  echo "torch already importable: $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else $(PIP) install torch==2.13.0; fi
	$(PIP) install triton numpy pybind11 cmake setuptools wheel
	$(PIP) install --no-deps nvidia-cutlass==4.2.0.0   # CUTLASS / CuTe headers only (pyproject build-system)
	$(PIP) install -v --no-build-isolation -e ".[test]"
	$(PIP) install --no-deps --ignore-requires-python megatron-core==0.19.2
	touch $@

# (re)compile csrc/ into gdn_packed/_C when the build inputs change; the log shows the nvcc lines
$(BUILD_STAMP): $(DEPS_STAMP) $(BUILD_INPUTS)
	$(PIP) install -v --no-build-isolation --no-deps -e .
	@$(VPY) -c "from gdn_packed import _cext as c; print('gdn_packed._C built:', c.built(), '| cuda available:', c.cuda_available(), '|', c.cuda_unavailable_reason() or 'ok')"
	touch $@

PYTEST_ARGS := -q -rfE --durations=25 --module-progress
SLOW_LANES := interpreter or aot or subprocess or megatron

test: venv
	GDN_PACKED_REQUIRE_C=$(REQUIRE_C) $(VPY) -m pytest $(PYTEST_ARGS) tests

test-fast: venv
	GDN_PACKED_REQUIRE_C=$(REQUIRE_C) $(VPY) -m pytest $(PYTEST_ARGS) -m "not ($(SLOW_LANES))" tests

test-aot: venv
	GDN_PACKED_AOT=full $(VPY) -m pytest -q tests/test_sm90_aot.py

bench: venv
	$(VPY) -m bench $(ARGS)

clean-build:
	rm -rf build gdn_packed/_C*.so $(BUILD_STAMP)

# -- a lent GPU (README "On a lent GPU") ------------------------------------------------------------
# gpu-check runs under .venv's python here and under the machine's python3 there (no .venv travels);
# it needs no set-up step, since the GPU machine has no package registry.
GPU_PY := $(if $(wildcard $(VPY)),$(VPY),python3)
DRY_RUN ?= 0
OUT ?=
gpu-check:
	$(GPU_PY) tools/gpu_check.py $(if $(filter-out 0 false no off,$(DRY_RUN)),--dry-run) $(if $(OUT),--out $(OUT))

# wheels for the GPU machine's python 3.12 (pure Python: fla-core; the image has einops, packaging)
WHEEL_DIR := .whl
GPU_WHEELS ?= fla-core==0.6.0 nvidia-cutlass==4.2.0.0
gpu-wheels:
	$(GPU_PY) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $(WHEEL_DIR) $(GPU_WHEELS)
	@ls -la $(WHEEL_DIR)

# side venvs with the GPU image's Triton (and its torch, a CUDA build that also runs CPU tensors),
# the in-tree package on PYTHONPATH (gdn_packed._C does not link torch, so the .so built here loads)
COMPAT_DIR := .compat
COMPAT_TRITON ?= 3.6.0
COMPAT_TORCH ?= 2.13.0 2.11.0
COMPAT_AOT = $(wildcard tests/test_*aot*.py tests/test_sm90*.py)
test-compat:
	@mkdir -p $(COMPAT_DIR); status=0; \
	for tv in $(COMPAT_TORCH); do \
	  env=$(COMPAT_DIR)/torch$$tv-triton$(COMPAT_TRITON); py=$$env/bin/python; \
	  [ -x $$py ] || $(PYTHON) -m venv $$env || exit 1; \
	  $$py -m pip install -q --disable-pip-version-check torch==$$tv triton==$(COMPAT_TRITON) numpy pybind11 \
	    pytest packaging einops rich matplotlib transformers || exit 1; \
	  $$py -m pip install -q --disable-pip-version-check --no-deps fla-core==0.6.0 || exit 1; \
	  vers=$$($$py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"); \
	  echo "== $$vers: device tests under the Triton interpreter, then AOT tests"; \
	  PYTHONPATH=$(CURDIR):$(CURDIR)/tools $$py -m pytest -q -p no:cacheprovider -p gpu_tests --device-tests \
	    tests 2>&1 | tee $$env/device.log | tail -n 15; dev=$${PIPESTATUS[0]}; \
	  PYTHONPATH=$(CURDIR) $$py -m pytest -q -p no:cacheprovider $(COMPAT_AOT) 2>&1 | tee $$env/aot.log \
	    | tail -n 15; aot=$${PIPESTATUS[0]}; \
	  echo "test-compat $$vers: device tests: $$(tail -n 1 $$env/device.log | tr -d '='), AOT: $$(tail -n 1 \
	    $$env/aot.log | tr -d '=')" > $$env/result.txt; \
	  [ $$dev = 0 ] && [ $$aot = 0 ] || status=1; \
	done; \
	echo "== results (each venv's in $(COMPAT_DIR)/*/result.txt):"; cat $(COMPAT_DIR)/*/result.txt; exit $$status
