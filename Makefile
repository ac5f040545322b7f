PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow lint bench clean

$(BIN)/python:
	@$(PY) -c "import sys; assert sys.version_info >= (3, 11), \"Python >= 3.11 needed; set PY=/path/to/python3.11\""
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-examples: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[examples]"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed-examples
	$(BIN)/python examples/demo.py

test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25 -m "not slow" tests

# the statistical tests marked slow (each compiles an SAEM program of its own; not in CI)
test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 -m slow tests

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

bench: $(VENV)/.installed-examples
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) out .pytest_cache
