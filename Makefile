# kda-cute: two commands do all set-up on a fresh machine.
#   make run    the main job: on a Hopper GPU, a KDA forward demo checked against the float64
#               reference; on a CPU-only machine, the AOT export of every shipped cubin
#   make test   install, build every shipped cubin, ruff, pytest (GPU tests skip without a GPU)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARCH ?= sm_90a

.PHONY: setup kernels run test lint gpu-check bench clean

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

# on the H200 (device machine), from the repo root with the cubins carried
gpu-check:
	bash scripts/gpu_check.sh

bench:
	python3 bench/bench.py

clean:
	rm -rf kda_cute/_cubins build *.egg-info
