# kda-cute: two commands do all set-up on a fresh machine.
#   make run    the main job: on a Hopper GPU, a KDA forward demo checked against the float64
#               reference; on a CPU-only machine, the AOT export of every shipped cubin
#   make test   install, build every shipped cubin, ruff, pytest (GPU tests skip without a GPU)
#   make wheel  every shipped cubin, then a wheel carrying them (dist/)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARCH ?= sm_90a

.PHONY: setup kernels run test lint wheel gpu-check bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

kernels: setup
	$(PY) -m kernels.build --arch $(ARCH)

run: kernels
	$(PY) -m kda_cute.demo

lint: setup
	$(PY) -m ruff check .

test: kernels lint
	$(PY) -m pytest -q

# a wheel with the cubins and manifests in it (no DSL needed where it is installed)
wheel: kernels
	$(PY) -m pip wheel . --no-deps --no-build-isolation -w dist

# on the H200 (device machine), from the repo root with the cubins carried
gpu-check:
	bash scripts/gpu_check.sh

bench:
	python3 bench/bench.py

clean:
	rm -rf kda_cute/_cubins build dist *.egg-info
