# Two entry points a fresh machine needs: `make demo` (main job) and `make test`.
# Both create the virtualenv and install everything they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo bench test clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Main job (until the closed-loop demo lands): the engine benchmark on the bundled small preset.
demo: setup
	$(VENV)/bin/vla-runtime bench --preset pi05-small --cameras 3 --repeats 5 --out out/bench.json

bench: demo

test: setup
	$(PY) -m pytest test -q

clean:
	rm -rf $(VENV) out .pytest_cache
