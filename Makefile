# The two Quick start commands are `make run` and `make test`; both create .venv and
# install the project with its test extras when needed (only python3 is required).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup postgresql chromium run demo test test-pure lint wheel wheel-test bench bench-spark bench-link bench-cluster bench-install soak soak-spark soak-record soak-broker clean

# The compiled core (setup.py): the sources of the modules listed in src/dataspace/_build.py
# (COMPILED_MODULES).  Editing one reinstalls, which compiles it again (about a minute of CPU).
CORE_SOURCES := $(shell $(PYTHON) -c 'import ast; t = ast.parse(open("src/dataspace/_build.py").read()); \
	print(*("src/" + m.replace(".", "/") + ".py" for n in t.body \
	if getattr(getattr(n, "target", None), "id", "") == "COMPILED_MODULES" for m in ast.literal_eval(n.value)))')

$(STAMP): pyproject.toml setup.py src/dataspace/_build.py $(CORE_SOURCES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	@echo "installing dataspace and its test extras into $(VENV) (compiling its core) ..."
	@$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@$(BIN)/python -c "import dataspace._build as b; print('dataspace core:', b.BUILD.describe())"
	@touch $(STAMP)

setup: $(STAMP)

# The benchmarks' own extras (nats-py for bench_link.py's NATS side by side).
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP) pyproject.toml
	@echo "installing the benchmarks' extras (.[bench]) into $(VENV) ..."
	@$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'
	@touch $(BENCH_STAMP)

## The main job: the dataspace server in the foreground (Ctrl-C stops it), with its HTTP
## port on loopback, so that `dataspace info`, `dataspace top` and the web inspector work.
run: setup
	$(BIN)/dataspace serve --http 127.0.0.1:7480

demo: setup
	$(BIN)/dataspace demo

# The PostgreSQL store's tests start a real PostgreSQL server (Debian's server binaries,
# /usr/lib/postgresql/*/bin): installed here with apt-get when missing and we are root;
# otherwise those tests fail saying how to get them.
postgresql:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1 \
	    && [ -z "$$DATASPACE_PG_BIN" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing the PostgreSQL server (apt-get install postgresql) for the store tests ..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends postgresql >/dev/null; \
	  else \
	    echo "no PostgreSQL server binaries: install them (apt-get install postgresql) or the" \
	         "PostgreSQL store tests fail"; \
	  fi; \
	fi

# The web inspector's tests drive a real browser: Debian's Chromium (/usr/bin/chromium),
# through Playwright (pinned in the test extra; its own browser download is not used).
# Installed here with apt-get when missing and we are root; otherwise those tests fail
# saying how to get it.
chromium:
	@if [ ! -x /usr/bin/chromium ] && ! command -v chromium >/dev/null 2>&1 \
	    && [ -z "$$DATASPACE_CHROMIUM" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Chromium (apt-get install chromium) for the web inspector's tests ..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium >/dev/null; \
	  else \
	    echo "no Chromium: install it (apt-get install chromium) or the web inspector's" \
	         "tests fail"; \
	  fi; \
	fi

# Where a C compiler is present the core must run compiled: the differential tests fail
# (rather than skip) when it does not.  Set DATASPACE_EXPECT_COMPILED=0 to allow pure Python.
DATASPACE_EXPECT_COMPILED ?= $(shell command -v $${CC:-cc} >/dev/null 2>&1 && echo 1 || echo 0)

## The whole test suite (lint first: a lint error fails the build like a test), on the
## compiled core; then the core's own tests again on the pure-Python core (test-pure).
test: setup postgresql chromium
	$(BIN)/ruff check src tests benchmarks
	DATASPACE_EXPECT_COMPILED=$(DATASPACE_EXPECT_COMPILED) $(BIN)/python -m pytest -q
	@$(MAKE) --no-print-directory test-pure

# The core, relay and dataspace tests on the pure-Python modules (DATASPACE_PURE=1: the
# compiled ones are not imported), a few minutes.
PURE_TESTS := tests/test_model.py tests/test_binary.py tests/test_text.py tests/test_pattern.py \
	tests/test_conformance_binary.py tests/test_conformance_text.py tests/test_conformance_cross.py \
	tests/test_index.py tests/test_dataspace.py tests/test_dataspace_limits.py \
	tests/test_protocol_relay.py tests/test_route.py tests/test_compiled_differential.py
test-pure: setup
	DATASPACE_PURE=1 DATASPACE_EXPECT_COMPILED=0 $(BIN)/python -m pytest -q $(PURE_TESTS)

lint: setup
	$(BIN)/ruff check src tests benchmarks

## The wheel: dist/dataspace-VERSION-TAGS.whl carrying the compiled core (mypyc, about a
## minute), for `pip install dist/dataspace-*.whl` (the broker) or with [spark], [postgres]
## or [all].  Built from this working tree; setuptools' build/lib is cleared first so that
## a file removed from src/ is not shipped from an earlier build.
wheel:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@rm -rf dist/dataspace-*.whl build/lib build/lib.* build/bdist.*
	@echo "building the wheel (compiling the core) ..."
	@$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --no-deps -w dist .
	@$(BIN)/python -c 'import glob, json, zipfile; w = glob.glob("dist/dataspace-*.whl")[0]; \
	  b = json.loads(zipfile.ZipFile(w).read("dataspace/_core_build.json")); \
	  print(w + ":", "compiled core," if b["compiled"] else "pure-Python core (" + b["reason"] + "),", \
	        len([n for n in zipfile.ZipFile(w).namelist() if n.endswith(".so")]), "extension modules")'

## The wheel as a user gets it: installed without extras into a fresh virtual environment,
## then the broker alone (serve, observe/send, a local pipeline, the missing-extra messages;
## tests/wheel_smoke.py, about a minute after the build).  CI runs it after `make test`.
wheel-test: wheel
	$(BIN)/python tests/wheel_smoke.py

## Every benchmark, printing figures (not part of the test suite).
bench: setup $(BENCH_STAMP)
	$(BIN)/python benchmarks/bench_core.py
	$(BIN)/python benchmarks/bench_broker.py
	$(BIN)/python benchmarks/bench_pipeline.py
	$(BIN)/python benchmarks/bench_spark.py
	$(BIN)/python benchmarks/bench_link.py
	$(BIN)/python benchmarks/bench_cluster.py

## The Spark benchmarks alone (connector vs Spark's file path, routing; about 4 minutes).
bench-spark: setup
	$(BIN)/python benchmarks/bench_spark.py

## Linked brokers beside NATS leaf nodes (about a minute; needs `apt-get install -y nats-server`).
bench-link: setup $(BENCH_STAMP)
	$(BIN)/python benchmarks/bench_link.py

## Broker clusters beside a NATS cluster (about 3 minutes; needs nats-server too).
bench-cluster: setup $(BENCH_STAMP)
	$(BIN)/python benchmarks/bench_cluster.py

## Each install form's size and time from the wheel: fresh environments, base, [postgres],
## [spark], [all] (benchmarks/bench_install.py; a few minutes, pip's cache warm).
bench-install: wheel
	$(BIN)/python benchmarks/bench_install.py

## The long crash test of the exactly-once engine: 1,000 SIGKILLs (about 7 minutes).
soak: setup
	$(BIN)/python -m dataspace.testing.pipeline_crash --kills 1000

## The long crash test of recording: 500 SIGKILLs of a recording server (about 6 minutes).
soak-record: setup
	$(BIN)/python -m dataspace.testing.record_crash --kills 500

## The long crash test of recording in a cluster: 200 SIGKILLs of members of a three-member
## cluster sharing a PostgreSQL store while clients send with syncs (about 25 minutes).
.PHONY: soak-cluster-record
soak-cluster-record: setup postgresql
	$(BIN)/python -m dataspace.testing.cluster_record --kills 200 --postgres

## The long crash test of the Spark engine: 200 SIGKILLs of the whole driver (about an hour).
soak-spark: setup
	$(BIN)/python -m dataspace.testing.spark_crash --kills 200

## The broker soak: a real server for 10 minutes under clients, attacks, fuzzing and kill -9.
soak-broker: setup
	$(BIN)/python -m dataspace.testing.broker_soak --seconds 600

## The long crash test of consumer groups: 200 SIGKILLs of four consumers while entries are
## appended, acknowledgements in the results' transaction then plain, on SQLite then on a
## throwaway PostgreSQL server (about 10 minutes).
.PHONY: soak-groups
soak-groups: setup postgresql
	$(BIN)/python -m dataspace.testing.group_crash --kills 200
	$(BIN)/python -m dataspace.testing.group_crash --kills 200 --postgres

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .hypothesis test-artifacts
