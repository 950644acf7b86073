# gdn_packed: set-up, tests and benchmarks.
#   make venv    .venv (python3.11, --system-site-packages so a machine's CUDA torch is reused),
#                dependencies, editable install that compiles csrc/ into gdn_packed/_C (when nvcc exists)
#   make test    the whole pytest suite
#   make bench   the microbenchmark CLI (python -m bench $(ARGS)); results in bench/results/local/
#                (ignored by git), ARGS="--help" lists the options
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

.PHONY: venv test bench clean-build

venv: $(BUILD_STAMP)

$(VPY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

# dependencies: torch only when the venv cannot import one (a CUDA torch on a GPU machine is kept)
$(DEPS_STAMP): $(VPY) pyproject.toml Makefile
	@if $(VPY) -c "import torch" >/dev/null 2>&1; then \
	  echo "torch already importable: $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else $(PIP) install torch==2.13.0; fi
	$(PIP) install triton numpy pybind11 cmake setuptools wheel
	$(PIP) install -v --no-build-isolation -e ".[test]"
	$(PIP) install --no-deps --ignore-requires-python megatron-core==0.19.2
	touch $@

# (re)compile csrc/ into gdn_packed/_C when the build inputs change; the log shows the nvcc lines
$(BUILD_STAMP): $(DEPS_STAMP) $(BUILD_INPUTS)
	$(PIP) install -v --no-build-isolation --no-deps -e .
	@$(VPY) -c "from gdn_packed import _cext as c; print('gdn_packed._C built:', c.built(), '| cuda available:', c.cuda_available(), '|', c.cuda_unavailable_reason() or 'ok')"
	touch $@

test: venv
	GDN_PACKED_REQUIRE_C=$(REQUIRE_C) $(VPY) -m pytest -q tests

bench: venv
	$(VPY) -m bench $(ARGS)

clean-build:
	rm -rf build gdn_packed/_C*.so $(BUILD_STAMP)
