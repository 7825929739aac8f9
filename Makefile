# Two commands do all the set-up: `make demo` and `make test`. Each creates .venv from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: venv test demo docs lint bench gpu-check tensorboard report clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PIP) install -q "torch>=2.4"
else
	# No GPU: take the CPU build of torch (a plain `torch` would pull a multi-GB CUDA build).
	$(PIP) install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  $(PIP) install -q --index-url https://download.pytorch.org/whl/cpu "torch==$(TORCH_VERSION)+cpu"
endif
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# The suite runs one worker per core (at most 4), a test file per worker at a time (module fixtures are
# built once); plain `.venv/bin/pytest` runs it in one process.
PYTEST_WORKERS ?= auto
test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --maxprocesses=4 --dist loadfile --durations=15

demo: venv  # make demo ARGS="--set train.seed=1 --keep": extra arguments of python -m train.demo
	$(PY) -m train.demo --out runs/demo $(ARGS)

RUN ?= runs/demo/run
tensorboard: venv  # make tensorboard RUN=runs/NAME
	$(VENV)/bin/tensorboard --logdir $(RUN)

report: venv  # make report RUN=runs/NAME
	$(VENV)/bin/dflash-train report $(RUN)

docs: venv
	# docs/config.md from the schema's field docstrings (tests/test_config_reference.py checks it)
	$(PY) -m dflash_cache.runtime.reference

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

gpu-check: venv
	# one prepared GPU check (<= 8 min on one H200): writes bench/results/gpu.json
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) runs .pytest_cache
