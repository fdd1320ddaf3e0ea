# Two commands on a fresh machine:  `make train` (the main job)  and  `make test`.
# Both create .venv and install upipe with torch==2.13.0 pinned.
# Which torch build that is depends on the index: on Linux x86_64 PyPI's torch 2.13.0 is the CUDA
# build (several GB with its nvidia-* wheels); a CPU-only machine gets the CPU build (192 MB) from
# PyTorch's CPU index with   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_INDEX ?=
# two pytest workers (the CI machine's two cores; WORKERS=n for another count, 0 for one
# process): the tests of the shared gloo clusters on one, the rest shared out (tests/conftest.py)
WORKERS ?= 2
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadgroup)

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,hf,train,integrations,jax]'
	touch $@

.PHONY: train demo test test-fast test-exhaustive test-explore test-torch lint
train: $(VENV)/.installed
	$(VENV)/bin/upipe train

demo: $(VENV)/.installed
	$(VENV)/bin/upipe demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# everything but the exhaustive tier: each claim on its representative cases
test: lint
	$(PY) -m pytest -q $(XDIST) -m "not exhaustive" --durations=25

# the rest of the matrices (every case of the planner's shortcut equalities, every documented
# command, each a pytest.mark.exhaustive); CI runs it after `make test`
test-exhaustive: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) -m exhaustive --durations=25

# the edit loop: tests/unit and tests/distributed, less the tests marked slow (tests/runs is all
# slow: training runs, planner simulations, subprocess CLIs)
FAST = tests/unit tests/distributed -m "not slow and not exhaustive"
test-fast: $(VENV)/.installed
	$(PY) -m pytest $(FAST) -q $(XDIST) --durations=10

# the fast tier on another torch release, each in its own venv (.venv-torch2.11.0 for
# TORCH=2.11.0): PyPI's build of it (on Linux x86_64 the CUDA build, several GB with its nvidia-*
# wheels; it runs on CPU) with upipe and its extras. PIP_CONSTRAINT=/dev/null replaces any
# constraint file in pip's config (a machine-wide cap on torch would refuse newer releases),
# for these installs only.
TORCH ?=
test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.11.0 (a release in >=2.11,<2.16)" >&2; exit 2; }
	$(MAKE) .venv-torch$(TORCH)/.installed
	.venv-torch$(TORCH)/bin/python -c "import torch; print('torch', torch.__version__)"
	.venv-torch$(TORCH)/bin/python -m pytest $(FAST) -q $(XDIST) --durations=10

.venv-torch%/.installed: pyproject.toml
	python3 -m venv .venv-torch$*
	PIP_CONSTRAINT=/dev/null .venv-torch$*/bin/python -m pip install --quiet torch==$*
	PIP_CONSTRAINT=/dev/null .venv-torch$*/bin/python -m pip install --quiet -e '.[dev,hf,train,integrations,jax]' torch==$*
	touch $@

# property tests on new random examples (the default run draws fixed ones): SEED=n
SEED ?= 0
test-explore: $(VENV)/.installed
	$(PY) -m pytest -q -k property --hypothesis-profile=explore --hypothesis-seed=$(SEED)
