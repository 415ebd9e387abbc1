# Two commands do all the set-up on a fresh machine with Python 3.10+ and the package index:
#   make demo   - create .venv, install, run the resumable-batch demo (SQLite + local state directory)
#   make test   - create .venv, install, run the test suite (starts its own moto S3 server on 127.0.0.1)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Pinned versions for reproducible installs (pyproject.toml keeps lower bounds only).
CONSTRAINTS := constraints/ci.txt
PYTEST_ARGS ?=

.PHONY: install test demo lint bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is needed, this is " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test,kubernetes,bench]'
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	@home=$$(mktemp -d -t stateful-demo-XXXXXX); \
	export AIRFLOW_HOME="$$home" AIRFLOW__CORE__LOAD_EXAMPLES=False AIRFLOW__CORE__DAGS_FOLDER="$(CURDIR)/dags"; \
	echo "AIRFLOW_HOME=$$home (SQLite metadata DB, state in $$home/stateful)"; \
	$(PY) -m airflow db migrate > "$$home/db-migrate.log" 2>&1 || { cat "$$home/db-migrate.log"; exit 1; }; \
	$(PY) dags/resumable_batch.py; rc=$$?; \
	echo "(the temporary AIRFLOW_HOME $$home is kept for inspection: rm -rf $$home)"; \
	exit $$rc

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
