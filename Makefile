# Two commands do all the set-up on a fresh machine:
#   make demo   installs into .venv, prepares the Shakespeare data set and trains the default model
#   make test   installs into .venv (with dev extras), checks the import layers and runs both test
#               layers: tests/unit (no process started; about a minute) then tests/integration
# make test-unit runs the unit layer alone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DATA   ?= data/shakespeare
RUN    ?= runs/demo

.PHONY: install demo test test-unit bench-quick clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first, pinned, so nothing pulls a multi-GB CUDA wheel.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/skiptrain demo --data $(DATA) --out $(RUN)

test: install
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q tests/unit tests/integration

test-unit: install
	$(PY) -m pytest -q tests/unit

bench-quick: install
	for b in bench/[!_]*.py; do $(PY) $$b --quick --json runs/bench/$$(basename $$b .py).json || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
