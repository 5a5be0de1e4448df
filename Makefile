# The two commands of the README: `make book` (set up + build the executed book) and `make test`.
# Both create .venv on first use and are safe to re-run.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
NB     ?= book/*.ipynb
# Idle OpenMP threads sleep instead of spinning: on a shared or oversubscribed 2-core machine spinning
# threads made the notebooks' many small ops 100x slower. Results are unchanged (it is a wait policy).
RUN    := OMP_WAIT_POLICY=PASSIVE

.PHONY: setup book test notebooks bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $@

# Executes every notebook listed in _toc.yml; any cell error or Sphinx warning fails the build.
book: setup
	$(RUN) $(BIN)/jupyter-book build . --warningiserror --keep-going

# Unit tests (tests/) and nbval over every notebook (book/); settings in pyproject.toml.
test: setup
	$(RUN) $(BIN)/python -m pytest

# Re-execute notebooks in place so their stored outputs become the new reference (NB=book/02_adam.ipynb).
notebooks: setup
	$(RUN) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=300 --ExecutePreprocessor.record_timing=False $(NB)

bench: setup
	$(BIN)/python benchmarks/bench_adamw.py
	$(BIN)/python benchmarks/bench_muon.py

clean:
	rm -rf _build .pytest_cache
