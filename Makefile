# `make demo` and `make test` set everything up on a fresh Debian machine (as root).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup host venv demo test test-quick docs bench clean

setup: host venv

host:
	bash scripts/setup-host.sh

venv: $(VENV)/.installed

# The three distributions of this checkout, editable: libdsec (the SDK), dsec (the server, at the
# root) and dsec-bench (the benchmarks; `dsec bench …`).
$(VENV)/.installed: pyproject.toml libdsec/pyproject.toml bench/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e './libdsec[gym]' -e '.[test]' -e './bench[peers]'
	touch $@

demo: setup
	$(BIN)/dsec demo

test: setup docs
	$(BIN)/ruff check --quiet src libdsec bench tests
	$(BIN)/lint-imports
	$(BIN)/python -m pytest --durations=30 $(PYTEST_ARGS)

# The quick subset (no crun, no mounts): seconds. The slow modules are not imported (tests/module_marks.py),
# and only they use hypothesis and schemathesis: their pytest plugins (3-4 s CPU to load) stay off.
test-quick: venv
	$(BIN)/ruff check --quiet src libdsec bench tests
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -m "not slow" -p no:hypothesispytest -p no:schemathesis $(PYTEST_ARGS)

# The SDK's API reference, from its docstrings (build/docs/libdsec.html); a warning fails it.
docs: venv
	$(BIN)/python -W error -m pdoc --docformat restructuredtext -o build/docs libdsec

bench: setup
	$(BIN)/dsec bench lifecycle

clean:
	rm -rf $(VENV) build src/*.egg-info libdsec/src/*.egg-info bench/src/*.egg-info .pytest_cache
