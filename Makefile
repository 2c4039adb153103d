# Two entry points for a fresh machine: `make test` and `make serve`.
# torch is pinned first: torch==2.13.0 is the CPU build on the project's machines; any other spec pulls a CUDA build
# of several GB. On a GPU host, install the CUDA torch you want into .venv first and `make` keeps it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test serve venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,serve]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# `make serve` serves the tiny model shipped with Rimuru; `make serve MODEL=Qwen/Qwen3-30B-A3B SERVE_ARGS="--port 9000"`
serve: $(STAMP)
	$(VENV)/bin/rimuru serve $(MODEL) $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
