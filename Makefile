# shoal: the two commands of the README, and a few more for developers.
#   make demo [DURATION=20]   bootstrap, then the embedded broker + pipeline + live view
#   make test                 bootstrap, then ruff, mypy, the import contracts and the whole pytest suite
#                             (on TEST_WORKERS pytest-xdist workers; TEST_WORKERS=0: one process)
#   make test-brokers         the real-broker integration, oracle and fault tests and a short
#                             chaos run on Mosquitto and on Mochi MQTT (docs/brokers.md)
#   make test-mochi-ci        a subset on Mochi: oracle + fault tests + a short chaos run (CI runs it
#                             after make test)
#   make mochi                build the Mochi MQTT broker (needs Go >= 1.21) into var/bin
# Bootstrap = a virtualenv in .venv with shoal installed (editable), Mosquitto on PATH and a
# PostgreSQL server installed (the sink tests start their own from its binaries).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DURATION ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` and `make test-mochi-ci`. Most of the suite waits (on
# brokers, subprocesses, timers) rather than computes, so more workers than cores pays off;
# tests that share a module-scoped fixture stay on one worker (tests/conftest.py).
TEST_WORKERS ?= 3
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS))
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export DEBIAN_FRONTEND := noninteractive

.PHONY: demo test bootstrap mosquitto postgres chromium view-assets lint test-slow bench clean mochi test-brokers test-mochi-ci

demo: bootstrap
	$(BIN)/shoal up $(if $(DURATION),--duration $(DURATION))

test: bootstrap
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest $(XDIST) $(PYTEST_ARGS)

test-slow: bootstrap
	$(BIN)/pytest -m slow $(PYTEST_ARGS)

bench: bootstrap
	$(BIN)/pytest -m benchmark $(PYTEST_ARGS)

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bootstrap: $(VENV)/.installed mosquitto postgres chromium

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "shoal needs Python 3.11 or newer; '$(PYTHON)' is $$($(PYTHON) --version 2>&1). Run: make PYTHON=python3.11 ..." >&2; exit 1; }
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing python3-venv with apt-get"; \
	    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null && $(PYTHON) -m venv $(VENV); \
	  else \
	    echo "cannot create a virtualenv: run 'sudo apt-get install -y python3-venv' and try again" >&2; exit 1; \
	  fi; }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@

mosquitto:
	@command -v mosquitto >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing mosquitto with apt-get"; \
	    apt-get update -qq && apt-get install -y -qq mosquitto mosquitto-clients >/dev/null; \
	  else \
	    echo "mosquitto is missing: run 'sudo apt-get install -y mosquitto mosquitto-clients' (or put mosquitto on PATH) and try again" >&2; exit 1; \
	  fi; }

# The second broker (issue 19): broker/mochi/main.go on Mochi MQTT, pinned by broker/mochi/go.sum,
# built once into var/bin/shoal-mochi (rebuilt when its sources change). Modules come from the
# Go module proxy into Go's module cache; -mod=mod reads go.mod/go.sum as committed.
GO ?= $(shell command -v go 2>/dev/null || { test -x /usr/local/go/bin/go && echo /usr/local/go/bin/go; })
MOCHI_BIN := var/bin/shoal-mochi
MOCHI_SRC := $(wildcard broker/mochi/*.go) broker/mochi/go.mod broker/mochi/go.sum

mochi: $(MOCHI_BIN)

$(MOCHI_BIN): $(MOCHI_SRC)
	@test -n "$(GO)" || { \
	  echo "Go is missing: the Mochi MQTT broker is built from broker/mochi with Go >= 1.21 (https://go.dev/doc/install, or 'apt-get install golang-go' if new enough); or set GO=/path/to/go" >&2; exit 1; }
	@mkdir -p $(@D)
	cd broker/mochi && GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0 $(GO) build -trimpath -o $(CURDIR)/$@ .
	@$@ -version | sed 's/^/built shoal-mochi on Mochi MQTT /'

# The integration tests (every real-broker test: oracle, fault, session, pool, security, CLI
# and a short chaos run; not `slow` or `benchmark`), once per broker. SHOAL_TEST_BROKER picks
# the broker every fixture and every EmbeddedBroker the tests start.
BROKER_TESTS ?= tests/integration
test-brokers: bootstrap mochi
	SHOAL_TEST_BROKER=mosquitto $(BIN)/pytest $(BROKER_TESTS) $(PYTEST_ARGS)
	SHOAL_TEST_BROKER=mochi $(BIN)/pytest $(BROKER_TESTS) $(PYTEST_ARGS)

# The part of test-brokers CI runs on Mochi (Mosquitto is covered by `make test`): the oracle
# tests, the fault and session tests and a short chaos run. Budget: 4 minutes.
MOCHI_CI_TESTS := $(shell cat tests/mochi-ci.txt 2>/dev/null)
test-mochi-ci: bootstrap mochi
	cd broker/mochi && GOFLAGS=-mod=mod GOTOOLCHAIN=local $(GO) test ./...
	SHOAL_TEST_BROKER=mochi $(BIN)/pytest $(XDIST) $(MOCHI_CI_TESTS) $(PYTEST_ARGS)

# `shoal sink postgres` tests and `shoal bench sink` run a throwaway server from these binaries
# (initdb into a temporary folder); nothing is configured or started system-wide by shoal.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing postgresql with apt-get"; \
	    apt-get update -qq && apt-get install -y -qq postgresql >/dev/null; \
	  else \
	    echo "PostgreSQL is missing: run 'sudo apt-get install -y postgresql' and try again" >&2; exit 1; \
	  fi; }

# The browser test of `shoal view` (tests/integration/test_view_browser.py) drives Debian's
# headless Chromium through the system chromedriver: nothing is downloaded at test time.
chromium:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium and chromium-driver with apt-get"; \
	    apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else \
	    echo "chromium is missing: run 'sudo apt-get install -y chromium chromium-driver' and try again" >&2; exit 1; \
	  fi; }

# The page of `shoal view` serves vendored, minified copies of mqtt.js and uPlot (committed in
# src/shoal/view/static/vendor/, so nothing is fetched at run time). To update them, change the
# exact versions in tools/view-assets/package.json and run this (needs npm and the registry).
view-assets:
	cd tools/view-assets && npm ci --ignore-scripts --no-audit --no-fund
	mkdir -p src/shoal/view/static/vendor
	cp tools/view-assets/node_modules/mqtt/dist/mqtt.min.js src/shoal/view/static/vendor/mqtt.min.js
	cp tools/view-assets/node_modules/uplot/dist/uPlot.iife.min.js src/shoal/view/static/vendor/uPlot.iife.min.js
	cp tools/view-assets/node_modules/uplot/dist/uPlot.min.css src/shoal/view/static/vendor/uPlot.min.css
	cp tools/view-assets/node_modules/mqtt/LICENSE.md src/shoal/view/static/vendor/mqtt.LICENSE.md
	cp tools/view-assets/node_modules/uplot/LICENSE src/shoal/view/static/vendor/uPlot.LICENSE
	cd tools/view-assets && node -e 'const l=require("./package-lock.json").packages; for (const n of ["mqtt","uplot"]) console.log(n, l["node_modules/"+n].version, l["node_modules/"+n].integrity)' > ../../src/shoal/view/static/vendor/VERSIONS

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis .import_linter_cache var
