# Two entry points: `make demo` (the main job) and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of PyTorch; override (e.g. TORCH_SPEC=torch) on a machine with a GPU.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# `make demo` needs the base install only (no pytest, lm-eval, triton or serving packages); `make test`'s dev install
# includes it, so its stamp stands for both.
DEMO_STAMP := $(VENV)/.installed-demo
# pytest-xdist workers for `make test` (CI has two cores; each worker keeps to one torch thread: tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: demo test install clean gpu-test

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e .
	touch $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/countdown demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# On a machine with a GPU, from source (e.g. the device tool: `make gpu-test PYTHON=python`): every test file
# that runs kernels (the harness's in tests/harness/ too), each kernel compiled for the GPU (the interpreter cannot
# see GPU-only compile errors); about 9 minutes on an H200, more than one 10-minute device call holds with its start,
# so `make gpu-test GPU_PART=1` and `GPU_PART=2` run the first and second half of the files (two calls). The SmolLM2
# download is left out: the device machines have no network.
GPU_FILES = $(shell grep -l "cuda.is_available" tests/test_*.py tests/harness/test_*.py)
GPU_HALF = $(shell echo $$(( ($(words $(GPU_FILES)) + 1) / 2 )))
GPU_PART ?= all
GPU_RUN = $(if $(filter 1,$(GPU_PART)),$(wordlist 1,$(GPU_HALF),$(GPU_FILES)),$(if $(filter 2,$(GPU_PART)),$(wordlist $(shell echo $$(( $(GPU_HALF) + 1 ))),999,$(GPU_FILES)),$(GPU_FILES)))
gpu-test:
	PYTHONPATH=src $(PYTHON) -m pytest -q -p no:cacheprovider -rf --deselect tests/test_models.py::test_real_smollm2_fetch_load_and_cache $(GPU_RUN)

clean:
	rm -rf $(VENV) demo_out
