# PROTON: `make book` builds the executed course into _build/html; `make test` runs every test.
# Both create (or reuse) the virtual environment .venv/ and install what they need into it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: book test test-nbs test-py check-export venv clean

venv: $(STAMP)

$(STAMP): setup.py settings.ini pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -c "import proton, nbdev, jupyter_book, pytest, seaborn"
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going

test: $(STAMP) check-export test-nbs test-py

test-nbs: $(STAMP)
	$(BIN)/nbdev_test --n_workers 2

test-py: $(STAMP)
	$(BIN)/python -m pytest tests -q

# the library must be exactly what the notebooks export, and the notebooks must be clean
check-export: $(STAMP)
	$(BIN)/nbdev_export
	$(BIN)/nbdev_clean
	git diff --exit-code --stat -- proton nbs
	test -z "$$(git ls-files --others --exclude-standard -- proton nbs)" || { git ls-files --others --exclude-standard -- proton nbs; echo "untracked files in proton/ or nbs/: add them"; exit 1; }

clean:
	rm -rf _build
