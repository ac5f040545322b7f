PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "python3.11 not found; set PY=/path/to/python3.11"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-examples: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[examples]"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed-examples
	$(BIN)/python examples/demo_breast_cancer.py

test: $(VENV)/.installed-test
	$(BIN)/ruff check numpyro_fed models examples benchmarks tests
	$(BIN)/python -m pytest -q tests

lint: $(VENV)/.installed-test
	$(BIN)/ruff check numpyro_fed models examples benchmarks tests

bench: $(VENV)/.installed-examples
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) out .pytest_cache
