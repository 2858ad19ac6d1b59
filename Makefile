# orbit-dagster: `make demo` and `make test` do all set-up themselves.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Reinstall when the dependencies change.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1)
export ORBIT_HOME ?= $(CURDIR)/.orbit
# The demo replays real preemption traces when the shared data set sits beside the checkout;
# without it, the market replays traces generated from the model fitted to them.
export ORBIT_SIM_TRACES ?= $(wildcard $(CURDIR)/../shared/data/traces)

.PHONY: install system-deps demo lint test test-all test-fast ui clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,hf,lightning]'
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

# Real services the integration and end-to-end tests use: sshd (an SSH rental host on
# loopback) and Chromium (the UI check). Installed only where missing.
system-deps:
	@scripts/system-deps.sh

demo: install
	$(BIN)/orbit demo

# The linter (ruff, configured in pyproject.toml): `make test` runs it first, so a lint error
# fails the suite in seconds.
lint: install
	$(BIN)/ruff check .

# Three lanes side by side (scripts/test.sh): end-to-end then the PostgreSQL scale test,
# integration, the rest.
test: install system-deps lint
	PYTHON=$(BIN)/python scripts/test.sh

# Everything, the opt-in tests too (`slow`: a run worker killed under the team profile, a few
# long duplicates of covered paths): tens of minutes.
test-all: install system-deps lint
	HYPOTHESIS_PROFILE=random ORBIT_SCALE_JOBS=20 PYTHON=$(BIN)/python scripts/test.sh -m ''

test-fast: install
	$(BIN)/python -m pytest -q tests/unit

ui: install
	$(BIN)/orbit ui --port $${PORT:-3000}

clean:
	rm -rf .orbit .pytest_cache
