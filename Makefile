# Two commands on a fresh machine:  `make train` (the main job)  and  `make test`.
# Both create .venv and install upipe with torch pinned (a CPU build where one is available).
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,hf,train,integrations,jax]'
	touch $@

.PHONY: train demo test lint
train: $(VENV)/.installed
	$(VENV)/bin/upipe train

demo: $(VENV)/.installed
	$(VENV)/bin/upipe demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q
