# The two commands of the README. Each works on a fresh machine: it builds .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml bench/pyproject.toml requirements-dev.txt requirements-torchtitan.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	# torchtitan's recipe test: --no-deps, so that nothing can replace the pinned torch
	$(BIN)/pip install -q --no-deps -r requirements-torchtitan.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/zerostall demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs --durations=15 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/zerostall bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
