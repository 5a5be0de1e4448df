# The two commands of the README: `make book` (set up + build the book) and `make test`.
# Both create .venv on first use and are safe to re-run.
PYTHON  ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
BIN     := $(VENV)/bin
NB      ?= book/*.ipynb
# Parallel pytest workers (pytest-xdist); every notebook runs whole on one worker.
JOBS    ?= 2
# `make book EXECUTE=force` re-executes every notebook while building (default: build from stored outputs).
EXECUTE ?= off
# CPU kernel configurations for `make nbval KERNELS=...` (see "Exact and measured outputs" in the README).
KERNELS ?= native
KERNELS_native  :=
KERNELS_avx2    := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2
KERNELS_generic := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_CBWR=COMPATIBLE
# Idle OpenMP threads sleep instead of spinning: on a shared or oversubscribed 2-core machine spinning
# threads made the notebooks' many small ops 100x slower. Results are unchanged (it is a wait policy).
RUN     := OMP_WAIT_POLICY=PASSIVE
PYTEST  := $(BIN)/python -m pytest -n $(JOBS) --dist loadfile

.PHONY: setup book student pdf test site-test nbval portability notebooks bench sweep clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $@

# Builds the HTML from the notebooks' stored outputs (fast; no kernel difference can fail it). Any Sphinx
# warning fails the build. EXECUTE=force re-executes every notebook first (a cell error fails the build).
# PYTHONPATH: _config.yml's local extension path (_ext) is relative to the config file, here the copy.
book: setup
	mkdir -p _build
	sed 's/^\(  execute_notebooks:\).*/\1 "$(EXECUTE)"/' _config.yml > _build/_config.yml
	$(RUN) PYTHONPATH=$(CURDIR)/_ext \
	  $(BIN)/jupyter-book build . --config _build/_config.yml --warningiserror --keep-going

# The book without solutions, for students: tools/student_build.py writes _build/student/src (solution
# drop-downs, solution cells and the hidden checks of quoted answers removed); built into _build/student/_build/html.
student: setup
	$(BIN)/python tools/student_build.py
	sed 's/^\(  execute_notebooks:\).*/\1 "off"/' _config.yml > _build/student/src/_config.yml
	$(RUN) PYTHONPATH=$(CURDIR)/_ext \
	  $(BIN)/jupyter-book build _build/student/src --path-output _build/student --warningiserror --keep-going

# The whole book as one PDF without LaTeX: the single-page HTML build, typeset by MathJax and printed by
# headless Chromium (Debian's chromium + chromium-driver, as for site-test): _build/pdf/book.pdf.
pdf: setup
	mkdir -p _build
	sed 's/^\(  execute_notebooks:\).*/\1 "off"/' _config.yml > _build/_config.yml
	$(RUN) PYTHONPATH=$(CURDIR)/_ext \
	  $(BIN)/jupyter-book build . --config _build/_config.yml --builder singlehtml --warningiserror --keep-going
	$(BIN)/python tools/build_pdf.py

# Unit tests (tests/) and nbval over every notebook (book/), in parallel; settings in pyproject.toml.
test: setup
	$(RUN) $(PYTEST)

# The built site (run `make book` first) in headless Chromium: Debian's chromium + chromium-driver, never
# downloaded (tests/test_site.py). Here a missing site or browser fails instead of skipping.
site-test: setup
	OPTBOOK_REQUIRE_SITE=1 $(RUN) $(BIN)/python -m pytest tests/test_site.py

# nbval alone, under one CPU kernel configuration: make nbval KERNELS=native|avx2|generic
nbval: setup
	$(RUN) $(KERNELS_$(KERNELS)) $(PYTEST) book

# The portability check: nbval under all three kernel configurations, one after the other.
portability: setup
	$(MAKE) nbval KERNELS=native
	$(MAKE) nbval KERNELS=avx2
	$(MAKE) nbval KERNELS=generic

# Re-execute notebooks in place so their stored outputs become the new reference (NB=book/02_adam.ipynb).
notebooks: setup
	$(RUN) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=600 --ExecutePreprocessor.record_timing=False $(NB)

# Re-run the seed and kernel sweep behind the measured claims (hours on 2 cores; not part of `test`).
sweep: setup
	$(BIN)/python sweeps/run.py $(NB)

bench: setup
	$(BIN)/python benchmarks/bench_adamw.py
	$(BIN)/python benchmarks/bench_muon.py
	$(RUN) $(BIN)/python benchmarks/bench_zero1.py

clean:
	rm -rf _build .pytest_cache
