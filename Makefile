# PROTON: `make book` builds the executed course into _build/html; `make test` runs every test.
# Both create (or reuse) the virtual environment .venv/ and install what they need into it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BOOK_FLAGS := -W -n --keep-going

.PHONY: book test test-nbs test-py test-site test-colab check-export browser perf clean

$(STAMP): setup.py settings.ini pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -c "import proton, nbdev, jupyter_book, pytest, seaborn, open_clip, pooch"
	touch $(STAMP)

# progress bars stay for people running the code; the rendered book shows none
book: $(STAMP)
	TQDM_DISABLE=1 $(BIN)/jupyter-book build . $(BOOK_FLAGS)

# everything CI runs: the export check, the notebooks' tests, pytest, then the site built and checked in a real browser
test: check-export test-nbs test-py test-site

# one torch thread per process: two notebook workers on two cores must not oversubscribe them
test-nbs: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/nbdev_test --n_workers 2

test-py: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -q --ignore=tests/test_site.py

test-site: book browser
	$(BIN)/python -m pytest tests/test_site.py -q

# the library must be exactly what the notebooks export, and the notebooks must be clean
check-export: $(STAMP)
	$(BIN)/nbdev_export
	$(BIN)/nbdev_clean
	git diff --exit-code --stat -- proton nbs
	test -z "$$(git ls-files --others --exclude-standard -- proton nbs)" || { git ls-files --others --exclude-standard -- proton nbs; echo "untracked files in proton/ or nbs/: add them"; exit 1; }

# Debian's Chromium for the browser test of the site
browser:
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# every chapter run top to bottom in a fresh, pip-installed environment, as in Colab (about 8 minutes)
test-colab: $(STAMP)
	PROTON_COLAB_TEST=1 $(BIN)/python -m pytest tests/test_colab_like.py -q

perf: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf _build
