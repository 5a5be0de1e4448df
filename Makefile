# The README's commands: `make book` (set up + build the book), `make test`, `make lab`, and the rest below.
# Every target creates .venv on first use and is safe to re-run.
PYTHON  ?= python3
VENV    ?= .venv
# Which torch goes into .venv (tools/install_torch.py; the outcome is in .venv/torch-source). Empty: what
# .venv/torch-source recorded, else torch==2.13.0 from PyTorch's CPU wheel index (pip's default index when
# that does not answer). A new value re-installs torch into an existing .venv: `make TORCH="torch>=2.9" setup`,
# `make torch-cuda` (PyPI's build, CUDA on Linux x86-64) or `make torch-cuda CUDA_INDEX=<PyTorch index URL>`.
TORCH       ?=
TORCH_INDEX ?=
CUDA_INDEX  ?= default
BIN     := $(VENV)/bin
NB      ?= book/*.ipynb
# What `make lab` opens (a notebook or a folder).
LAB     ?= book/00_preface.ipynb
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

.PHONY: capstone conformance grade grade-setup gpu-check setup python-version torch-cuda torch-cpu lab book student pdf pdf-numbers test site-test nbval portability notebooks bench \
        sweep clean

INSTALL_TORCH := $(BIN)/python tools/install_torch.py --venv $(VENV) --torch "$(TORCH)" --index "$(TORCH_INDEX)"

# The venv, torch and requirements.txt; then torch again when TORCH/TORCH_INDEX asks for another build
# (nothing happens when .venv/torch-source already records the request).
setup: $(VENV)/.installed
	@$(INSTALL_TORCH)

# Python 3.10 or newer (pyproject.toml's requires-python), checked before .venv is created: with an older
# one pip fails later with "ResolutionImpossible", which never names Python, and leaves a .venv behind.
# A .venv that an older Python made is named too (remove it, then run make again).
PYTHON_MIN := 3.10
OLD_PYTHON = { v=$$($(1) --version 2>&1 | sed -n 's/^Python \([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p'); set -- $$v; \
	[ -z "$$v" ] || [ "$$1" -lt 3 ] || { [ "$$1" -eq 3 ] && [ "$$2" -lt 10 ]; }; }
python-version:
	@if $(call OLD_PYTHON,$(PYTHON)); then \
	  echo "make: Python $(PYTHON_MIN) or newer is needed; PYTHON=$(PYTHON) is $$($(PYTHON) --version 2>&1 | head -1)." \
	    "Run again with a newer one, e.g. make PYTHON=python3.12 (nothing was installed)." >&2; exit 1; fi
	@if [ -x $(BIN)/python ] && $(call OLD_PYTHON,$(BIN)/python); then \
	  echo "make: $(VENV) was made by $$($(BIN)/python --version 2>&1 | head -1), older than $(PYTHON_MIN):" \
	    "remove it (rm -rf $(VENV)) and run make again." >&2; exit 1; fi

$(VENV)/.installed: requirements.txt pyproject.toml
	@$(MAKE) --no-print-directory python-version
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(INSTALL_TORCH)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $@

# Switch the torch of an existing .venv: PyPI's build (CUDA on Linux x86-64) or CUDA_INDEX=<index URL>,
# and back to the CPU build. The choice is recorded in .venv/torch-source and kept by later `make` runs.
torch-cuda: $(VENV)/.installed
	$(MAKE) setup TORCH_INDEX=$(CUDA_INDEX)

torch-cpu: $(VENV)/.installed
	$(MAKE) setup TORCH_INDEX=cpu

# JupyterLab on the chapters, from the venv (installed on first use: the `lab` extra of pyproject.toml).
# LAB=book/06_muon.ipynb opens another chapter; the kernel is the venv's Python.
# JupyterLab refuses to run as root (containers) unless told.
LAB_FLAGS = $(if $(filter 0,$(shell id -u)),--allow-root)
lab: setup $(VENV)/.lab
	$(RUN) $(BIN)/jupyter lab $(LAB_FLAGS) $(LAB)

$(VENV)/.lab: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[lab]"
	touch $@

# Grade students' copies of chapters (tools/grade.py, otter-grader): make grade NB=submissions/alice_02_adam.ipynb
# (several files or a glob grade a class; CHAPTER=02_adam when the file names do not contain the chapter).
# Prints each graded exercise's score with feedback; otter-grader (the `grade` extra) is installed on first use.
CHAPTER ?=
grade: setup $(VENV)/.grade
	$(RUN) $(BIN)/python tools/grade.py $(if $(CHAPTER),--chapter $(CHAPTER)) $(NB)

# The grader alone (otter-grader, the `grade` extra): CI installs it before `make test` so that
# tests/test_grade.py grades the solutions and a blank notebook instead of skipping.
grade-setup: setup $(VENV)/.grade

$(VENV)/.grade: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[grade]"
	touch $@

# Builds the HTML from the notebooks' stored outputs (fast; no kernel difference can fail it). Any Sphinx
# warning fails the build. EXECUTE=force re-executes every notebook first (a cell error fails the build).
# PYTHONPATH: _config.yml's local extension path (_ext) is relative to the config file, here the copy.
book: setup
	mkdir -p _build
	sed 's/^\(  execute_notebooks:\).*/\1 "$(EXECUTE)"/' _config.yml > _build/_config.yml
	$(RUN) PYTHONPATH=$(CURDIR)/_ext \
	  $(BIN)/jupyter-book build . --config _build/_config.yml --warningiserror --keep-going
	cp _static/* _build/html/_static/  # Sphinx skips its static copy when no page is out of date

# The book without solutions, for students: tools/student_build.py writes _build/student/src (solution
# drop-downs, solution cells and the hidden checks of quoted answers removed); built into _build/student/_build/html.
student: setup
	$(BIN)/python tools/student_build.py
	sed 's/^\(  execute_notebooks:\).*/\1 "off"/' _config.yml > _build/student/src/_config.yml
	$(RUN) PYTHONPATH=$(CURDIR)/_ext \
	  $(BIN)/jupyter-book build _build/student/src --path-output _build/student --warningiserror --keep-going

# The whole book as one PDF without LaTeX: the single-page HTML build, typeset by MathJax and printed by
# headless Chromium (Debian's chromium + chromium-driver, as for site-test): _build/pdf/book.pdf and its
# page, formula and notebook counts in _build/pdf/book.json. It writes nothing outside _build.
pdf: setup
	mkdir -p _build
	sed 's/^\(  execute_notebooks:\).*/\1 "off"/' _config.yml > _build/_config.yml
	$(RUN) PYTHONPATH=$(CURDIR)/_ext \
	  $(BIN)/jupyter-book build . --config _build/_config.yml --builder singlehtml --warningiserror --keep-going
	$(BIN)/python tools/build_pdf.py --out _build/pdf/book.pdf

# The PDF, then its counts recorded in records/pdf.json and quoted in CONTRIBUTING.md (for a maintainer).
pdf-numbers: pdf
	cp _build/pdf/book.json records/pdf.json
	$(BIN)/python tools/readme_numbers.py --write

# Unit tests (tests/) and nbval over every notebook (book/), in parallel; settings in pyproject.toml.
test: setup
	$(RUN) $(PYTEST)

# The built site (run `make book` first) in headless Chromium: Debian's chromium + chromium-driver, never
# downloaded (tests/test_site.py). Here a missing site or browser fails instead of skipping.
site-test: setup
	OPTBOOK_REQUIRE_SITE=1 $(RUN) $(BIN)/python -m pytest tests/test_site.py tests/test_site_interactive.py

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

# Every benchmark under the environment of every other target ($(RUN)); each prints that environment
# above its table and records both in benchmarks/results/NAME.json; then the README's tables are rewritten
# from the records (tools/readme_numbers.py: README.md, CONTRIBUTING.md, benchmarks/README.md).
BENCHMARKS := bench_adamw bench_muon bench_zero1 bench_fsdp2 bench_compiled_step bench_newton_schulz bench_contract_overhead \
              bench_quickstart bench_limits bench_wrapper_base
bench: setup
	$(foreach b,$(BENCHMARKS),$(RUN) $(BIN)/python benchmarks/$(b).py &&) true
	$(BIN)/python tools/readme_numbers.py --write

# Chapter 19's full table (tools/capstone.py): AdamW, Muon, NorMuon and Dion on real text, 10 seeds each at
# learning rates tuned on two other seeds, plus max attention logits with and without QK-clip; writes
# records/capstone.json, which book/19_capstone.ipynb reads. CUDA when present; about 5 minutes on 2 CPU cores.
capstone: setup
	$(RUN) $(BIN)/python tools/capstone.py

clean:
	rm -rf _build .pytest_cache

# One prepared check for a machine with a CUDA GPU (a CUDA build of torch: `make torch-cuda`): Newton-Schulz
# TFLOP/s against the measured bf16 matmul rate, the symmetric Gram kernel against bmm, Gram against standard
# Newton-Schulz (tools/gpu_check.py: _build/gpu_check.json and one verdict line; a FAIL stops here with exit
# status 1), nbval of chapters 5, 6 and 15
# on the GPU, and the ZeRO-1 demo over NCCL under torchrun on every visible GPU. `make gpu-check DRY_RUN=1`
# runs the same script end to end on a CPU with small shapes and no verdict (CI runs it).
DRY_RUN ?=
gpu-check: setup
	mkdir -p _build
ifeq ($(DRY_RUN),1)
	$(RUN) $(BIN)/python tools/gpu_check.py --dry-run --json _build/gpu_check.json
else
	$(RUN) $(BIN)/python tools/gpu_check.py --json _build/gpu_check.json
	$(RUN) $(PYTEST) book/05_newton_schulz.ipynb book/06_muon.ipynb book/15_fast_newton_schulz.ipynb
	$(RUN) $(BIN)/torchrun --nproc_per_node=$$($(BIN)/python -c 'import torch; print(torch.cuda.device_count())') -m optbook.distributed.demo --steps 50 --bf16
endif

# The conformance matrix: each optimizer against independent implementations (torch.optim, pytorch-optimizer,
# schedulefree, optax on JAX's CPU backend), the settings that make them agree to 1e-12 over 50 float64 steps
# or the step where they differ and why. Installs the optional extra `conformance` into .venv first; the table
# it generates is tests/conformance_table.md (OPTBOOK_UPDATE_CONFORMANCE=1 rewrites it). Then Gram Newton-Schulz
# against Dao-AILab's gram-newton-schulz, installed without its GPU-only dependencies; required here, not skipped.
conformance: setup
	$(BIN)/python -m pip install --quiet -e '.[conformance]'
	$(RUN) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -o addopts="" -n 0 -rs tests/test_conformance.py
	$(BIN)/python -m pip install --quiet --target _build/extpkgs --no-deps --upgrade gram-newton-schulz==0.1.6
	$(RUN) OPTBOOK_EXTERNAL_PACKAGES=$(CURDIR)/_build/extpkgs OPTBOOK_REQUIRE_EXTERNAL=1 \
	  $(BIN)/python -m pytest -q -o addopts="" -n 0 -rs tests/test_gram_newton_schulz.py -k dao_ailab

# PyTorch's generic optimizer checks on every optbook class (tests/torch_suite/: our checks mirroring torch's
# TestOptimRenewed, run on torch's OptimizerInfo entries with optbook's classes swapped in, and on entries of our
# own), with torch's own classes as the control. Prints the pass counts; fails unless the control passes every
# check and optbook passes the control's count minus the documented deviations (DEVIATIONS in
# tests/torch_suite/torch_suite_infos.py). Not part of `make test` (minutes on 2 cores).
.PHONY: torch-suite
torch-suite: setup
	$(RUN) $(BIN)/python -m pytest -q -p no:cacheprovider -o addopts="" -n $(JOBS) tests/torch_suite/
