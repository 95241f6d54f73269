# Two commands do everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-unit test-model lint bench-sim clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/cohort serve

test: install
	$(BIN)/python -m pytest -q

# Every test that needs no service (no Redis, PostgreSQL or spawned stack), runs no language model
# (marked `model`: tests/model and the deployer's load checks; `make test-model`) and is not marked
# slow (a second or more of real computation); `make test` runs them all. The fast loop, one
# pytest-xdist worker per core; tests/e2e and tests/model are not even imported. Bytecode is cached even where
# PYTHONDONTWRITEBYTECODE is set: otherwise every run recompiles the project and re-does pytest's
# assertion rewriting of every test module and of the plugin packages it marks (schemathesis,
# hypothesis, anyio), seconds per worker.
test-unit: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m "not e2e and not slow and not model" --ignore=tests/e2e \
		--ignore=tests/model -n auto

# Every test that runs a language model (the tiny Llama behind the built-in engine), slow ones too.
test-model: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m "model and not e2e" --ignore=tests/e2e -n auto

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf var .pytest_cache
