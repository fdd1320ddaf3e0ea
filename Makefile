# Two commands on a fresh machine:  `make train` (the main job)  and  `make test`.
# Both create .venv and install upipe with torch==2.13.0 pinned.
# Which torch build that is depends on the index: on Linux x86_64 PyPI's torch 2.13.0 is the CUDA
# build (several GB with its nvidia-* wheels); a CPU-only machine gets the CPU build (192 MB) from
# PyTorch's CPU index with   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_INDEX ?=

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,hf,train,integrations,jax]'
	touch $@

.PHONY: train demo test test-fast test-explore lint
train: $(VENV)/.installed
	$(VENV)/bin/upipe train

demo: $(VENV)/.installed
	$(VENV)/bin/upipe demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q --durations=25

# the edit loop: all but the tests marked slow (training runs, planner simulations, CLIs)
test-fast: $(VENV)/.installed
	$(PY) -m pytest -m "not slow" -q --durations=10

# property tests on new random examples (the default run draws fixed ones): SEED=n
SEED ?= 0
test-explore: $(VENV)/.installed
	$(PY) -m pytest -q -k property --hypothesis-profile=explore --hypothesis-seed=$(SEED)
