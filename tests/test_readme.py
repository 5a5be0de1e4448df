"""The README as a new user reads it: short (at most 250 lines), every command block names real targets,
files, modules and options and runs from the repository root as written, in the README's own order (the
cheap ones are run here, make targets as ``make -n``), every Python snippet runs, and the measured numbers
agree with the records they come from. The same for CONTRIBUTING.md and benchmarks/README.md, where the
rest moved (CONTRIBUTING.md's layout block must match the tree)."""

import contextlib
import io
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_tool, scaled_timeout

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONTRIBUTING = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
BENCHMARKS = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
API = (ROOT / "book" / "api_contract.md").read_text(encoding="utf-8")
RECORDS = (ROOT / "records" / "README.md").read_text(encoding="utf-8")
PAGES = {"README.md": README, "CONTRIBUTING.md": CONTRIBUTING, "benchmarks/README.md": BENCHMARKS,
         "records/README.md": RECORDS}



readme_numbers = load_tool("readme_numbers")
install_torch = load_tool("install_torch")


def blocks(lang, text=README):
    return re.findall(rf"(?ms)^```{lang}\n(.*?)^```$", text)


def commands(text=README):
    """Every command line of the page's ``bash`` blocks, in its order: continuations joined, comments dropped."""
    out = []
    for block in blocks("bash", text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(words)
    return out


MAKE_TARGETS = set(re.findall(r"(?m)^([\w-]+):", (ROOT / "Makefile").read_text()))


def options_in(path: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text()))


def module_file(name: str) -> Path:
    path = ROOT / "src" / Path(*name.split("."))
    return path / "__main__.py" if (path / "__main__.py").exists() else path.with_suffix(".py")


def check_options(args, path, problems, line):
    known = options_in(path)
    for arg in args:
        opt = arg.split("=")[0]
        if opt.startswith("--") and opt not in known:
            problems.append(f"{line}: {opt} is not an option of {path.relative_to(ROOT)} ({sorted(known)})")


def check_venv_python(args, problems, line):
    """``.venv/bin/python SCRIPT ...`` or ``.venv/bin/python -m MODULE ...``."""
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "pytest":
            paths = [a for a in rest if not a.startswith("-")]
            problems += [f"{line}: {p} does not exist" for p in paths if not (ROOT / p).exists()]
            if not paths:
                problems.append(f"{line}: pytest without a path")
        elif module.startswith("optbook"):
            if not module_file(module).exists():
                problems.append(f"{line}: no module {module}")
            else:
                check_options(rest, module_file(module), problems, line)
        else:
            problems.append(f"{line}: unexpected module {module}")
        return
    script = ROOT / args[0]
    if not script.is_file():
        problems.append(f"{line}: {args[0]} does not exist")
    else:
        check_options(args[1:], script, problems, line)


def check_command(words, problems):
    line = " ".join(words)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # environment assignments
        words = words[1:]
    cmd, args = words[0], words[1:]
    if cmd == "make":
        targets = [a for a in args if "=" not in a] or ["book"]
        problems += [f"{line}: no Makefile target {t}" for t in targets if t not in MAKE_TARGETS]
        dry = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True)
        if dry.returncode != 0:
            problems.append(f"{line}: make -n failed: {dry.stderr[-500:]}")
    elif cmd == ".venv/bin/python":
        check_venv_python(args, problems, line)
    elif cmd == ".venv/bin/torchrun":
        module = args[args.index("-m") + 1]
        check_options(args[args.index("-m") + 2:], module_file(module), problems, line)
    elif cmd == "source":
        assert args == [".venv/bin/activate"], line
    elif cmd == "cat":
        assert args == [f".venv/{install_torch.RECORD_NAME}"], line
    elif cmd == "sudo":  # the browser test's Debian packages: the same that .ci/run installs
        packages = [a for a in args[2:] if not a.startswith("-")]
        ci = (ROOT / ".ci" / "run").read_text()
        problems += [f"{line}: .ci/run does not install {p}" for p in packages if p not in ci.split()]
    elif cmd == "python3" and args[:2] == ["-m", "venv"]:  # the package alone, in the reader's own environment
        pass
    elif cmd.endswith("/bin/python") and args[:3] == ["-m", "pip", "install"]:
        target = args[3]
        url = readme_numbers.config_url(ROOT)
        if target == install_torch.DEFAULT_TORCH:   # the book's torch, from PyTorch's CPU wheel index
            if args[4:] != ["--index-url", "https://download.pytorch.org/whl/cpu"]:
                problems.append(f"{line}: {target} without PyTorch's CPU wheel index")
        elif target not in (".", f"optbook @ git+{url}"):
            problems.append(f"{line}: installs {target!r}, expected . or optbook @ git+{url}")
    else:
        problems.append(f"{line}: not a make target, a .venv program or a known system command")


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 250, len(README.splitlines())


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_every_command_block_names_real_targets_files_and_options(page):
    """Each command of the page, in the page's order, as a fresh clone would meet it."""
    found = commands(PAGES[page])
    assert len(found) >= {"README.md": 10, "CONTRIBUTING.md": 15, "benchmarks/README.md": 1, "records/README.md": 0}[page]
    problems = []
    for words in found:
        check_command(words, problems)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_inline_commands_use_make_or_the_venv(page):
    spans = re.findall(r"`([^`\n]+)`", PAGES[page])
    bare = [s for s in spans if re.match(r"(python3?|pytest|torchrun|pip|jupyter) ", s)]
    assert not bare, f"commands that need the venv but do not name it: {bare}"
    problems = []
    for span in spans:
        if span.startswith("make "):
            check_command(shlex.split(span), problems)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("argv", [["tools/set_repository_url.py", "--check"], ["tools/readme_numbers.py", "--check"]],
                         ids=lambda a: a[0])
def test_cheap_commands_run(argv):
    assert [".venv/bin/python", *argv] in commands(CONTRIBUTING)
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=scaled_timeout(60))
    assert out.returncode == 0, out.stdout + out.stderr


def test_numbers_agree_with_the_records():
    for name, text in PAGES.items():
        assert readme_numbers.render(text) == text, (
            f"{name} disagrees with the records: run .venv/bin/python tools/readme_numbers.py --write")
    keys = {name: set(re.findall(r"<!-- numbers:([\w:-]+) -->", text)) for name, text in PAGES.items()}
    assert {"tests", "chapter-times", "book-link", "install", "citation", "quickstart"} <= keys["README.md"]
    assert "pdf" in keys["CONTRIBUTING.md"]
    assert {f"bench:{p.stem}" for p in (ROOT / "benchmarks").glob("bench_*.py")} <= keys["benchmarks/README.md"]
    assert [str(p.relative_to(ROOT)) for p in readme_numbers.PAGES] == list(PAGES)
    # one current table per benchmark in benchmarks/README.md; the earlier runs in records/README.md
    runs = {"muon-runs", "zero1-targets", "adamw-runs", "compiled-runs", "fsdp2-runs"}
    assert runs <= keys["records/README.md"] and not runs & keys["benchmarks/README.md"]
    citation = (ROOT / "CITATION.cff").read_text()
    assert readme_numbers.citation_text(citation) == citation


def test_every_benchmark_record_states_its_environment():
    import json

    for name in [p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")]:
        record = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
        env = record["environment"]
        assert {"date", "cpu", "cores", "torch", "threads"} <= set(env), name
        assert "OMP_WAIT_POLICY" in env["env"], name
        assert record["table"], name


def test_make_bench_runs_every_benchmark_under_the_same_environment():
    dry = subprocess.run(["make", "-n", "bench"], cwd=ROOT, capture_output=True, text=True).stdout
    runs = re.findall(r"(\S+=\S+) \S+/python benchmarks/(bench_\w+)\.py", dry)
    assert sorted(name for _, name in runs) == sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert {env for env, _ in runs} == {"OMP_WAIT_POLICY=PASSIVE"}
    test_recipe = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "OMP_WAIT_POLICY=PASSIVE" in test_recipe


def test_the_demo_options_are_all_listed():
    section = README[README.index("## Multi-process and multi-GPU"):README.index("```bash", README.index(
        "## Multi-process and multi-GPU"))]
    listed = set(re.findall(r"`(--[\w-]+)", section)) - {"--help"}
    assert listed == options_in(module_file("optbook.distributed.demo"))


def test_ci_description_matches_ci():
    ci = [" ".join(line.split()) for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("make ")]
    paragraph = CONTRIBUTING[CONTRIBUTING.index("CI is `.ci/run`"):].split("\n\n")[0]
    positions = [paragraph.index(f"`{c}`") for c in ci]
    assert positions == sorted(positions) and len(ci) == 9, (ci, paragraph)


def run_snippet(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(source, "README.md", "exec"), namespace)
    return namespace, out.getvalue()


CHECKED_BELOW = ("weight_decay_param_groups", "ChainedOptimizer(")  # the snippets with their own tests


def test_every_other_python_snippet_runs(tmp_path, monkeypatch):
    snippets = blocks("python")
    assert all(sum(k in b for b in snippets) == 1 for k in CHECKED_BELOW), "the package quick start's snippets"
    for source in [b for b in snippets if not any(k in b for k in CHECKED_BELOW)]:
        run_snippet(source, tmp_path, monkeypatch)


def test_adamw_snippet_runs(tmp_path, monkeypatch):
    source = next(b for b in blocks("python") if CHECKED_BELOW[0] in b)
    ns, _ = run_snippet(source, tmp_path, monkeypatch)
    decays = {id(p): g["weight_decay"] for g in ns["opt"].param_groups for p in g["params"]}
    model = ns["model"]
    assert decays[id(model[0].weight)] == 0.1 and decays[id(model[0].bias)] == 0.0
    assert decays[id(model[1].weight)] == 0.0


def test_muon_adamw_loop_trains_and_its_checkpoint_resumes(tmp_path, monkeypatch):
    source = next(b for b in blocks("python") if CHECKED_BELOW[1] in b)
    assert len(source.strip().splitlines()) <= 25
    ns, printed = run_snippet(source, tmp_path, monkeypatch)
    model, opt, sched = ns["model"], ns["opt"], ns["sched"]
    # routing: hidden matrices to Muon, embedding and norms to AdamW, and the table says so
    muon_ids = {id(p) for g in opt.optimizers[0].param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in muon_ids) == (p.ndim == 2 and "emb" not in name and "head" not in name), name
    assert "Muon" in printed and "AdamW" in printed
    # it learned to copy: untrained the loss is log(16) = 2.77 on the scored half
    assert ns["loss"].item() < 0.25 * math.log(16)
    assert sched.samples == 100 * 16 and opt.last_grad_norm is not None
    # the checkpoint restores model, optimizer and schedule: one more step from it is bitwise the same
    setup = source[:source.index("for step")]
    fresh, _ = run_snippet(setup.replace("torch.manual_seed(0)", "torch.manual_seed(1)"), tmp_path, monkeypatch)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    fresh["model"].load_state_dict(ckpt["model"])
    fresh["opt"].load_state_dict(ckpt["optim"])
    fresh["sched"].load_state_dict(ckpt["sched"])
    assert [g["lr"] for g in fresh["opt"].param_groups] == [g["lr"] for g in opt.param_groups]
    inputs, targets = ns["copy_task"](16, 16, 16, generator=torch.Generator().manual_seed(5))
    for run in (ns, fresh):
        loss = torch.nn.functional.cross_entropy(run["model"](inputs).flatten(0, 1), targets.flatten())
        run["opt"].zero_grad()
        loss.backward()
        run["opt"].step()
    for a, b in zip(model.parameters(), fresh["model"].parameters()):
        assert torch.equal(a, b)


def layout_block():
    section = CONTRIBUTING[CONTRIBUTING.index("## Layout"):]
    return re.search(r"(?ms)^```\n(.*?)^```$", section).group(1)


def tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return [Path(p) for p in out.stdout.splitlines() if (ROOT / p).exists()]
    return [p.relative_to(ROOT) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]


def test_layout_block_matches_the_tree():
    block = layout_block()
    words = set(re.findall(r"[\w.-]+/?", block)) | set(re.findall(r"[\w./-]+", block))
    files = tracked_files()
    top = {p.parts[0] + ("/" if len(p.parts) > 1 else "") for p in files} - {".gitignore"}
    missing = sorted(t for t in top if t not in words and t.rstrip("/") + "/" not in words)
    assert not missing, f"top-level entries not in the layout block: {missing}"
    wanted = set()
    for p in files:
        if p.parts[:2] == ("src", "optbook") and len(p.parts) in (3, 4) and not p.name.startswith("_"):
            wanted.add(p.name if len(p.parts) == 3 else p.parts[2] + "/")
            if p.parts[2] in ("distributed", "models", "optim") and p.suffix == ".py":
                wanted.add(p.name)
        if p.parts[0] in ("tools", "benchmarks") and p.suffix == ".py" and len(p.parts) == 2:
            wanted.add(p.name)
    assert not sorted(wanted - words), f"not in the layout block: {sorted(wanted - words)}"
    on_disk = [p.relative_to(ROOT) for p in ROOT.rglob("*")
               if not {".venv", ".git", "_build"} & set(p.relative_to(ROOT).parts)]
    names = {p.name for p in on_disk}
    invented = sorted(w for w in re.findall(r"\b[\w-]+\.(?:py|json|txt|toml|yml|md|bib|css|svg|cff)\b", block)
                      if w not in names)
    assert not invented, f"the layout block names files that do not exist: {invented}"


def test_license_and_citation():
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "THE SOFTWARE IS PROVIDED \"AS IS\"" in license_text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'(?m)^license = "MIT"$', pyproject)
    fields = readme_numbers.citation_fields((ROOT / "CITATION.cff").read_text())
    assert fields["cff-version"] == "1.2.0" and fields["license"] == "MIT"
    assert fields["version"] == re.search(r'(?m)^version = "([^"]+)"$', pyproject).group(1)
    assert "[`LICENSE`](LICENSE)" in README and "[`CITATION.cff`](CITATION.cff)" in README


def test_the_contract_table_and_the_composition_matrix_are_on_the_api_page_and_linked():
    for heading, marker in (("## The step contract", "contract-table"), ("## The composition matrix", "composition-matrix")):
        start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
        assert API.count(start) == 1 and API.count(end) == 1 and start not in README
        assert API.index(heading) < API.index(start) < API.index(end)
        section = API[API.index(heading):].split("\n## ")[0]
        assert start in section and end in section
    assert "(book/api_contract.md)" in README and "(book/api_contract.md)" in CONTRIBUTING


def make_dry_run(target: str, venv: Path) -> str:
    """``make -n TARGET`` against the virtual environment ``venv`` (not the repository's own ``.venv``, whose
    state depends on which targets ran before: after a first ``make lab`` nothing is left to install)."""
    return subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled_timeout(60)).stdout


def test_quick_start_opens_the_chapters_in_jupyterlab(tmp_path):
    quick = README[README.index("## Quick start: the book"):README.index("## Quick start: the package")]
    assert "make lab" in quick and "lab" in MAKE_TARGETS
    dry = make_dry_run("lab", tmp_path / "fresh")   # a fresh clone: the venv, then the lab extra, then the lab
    assert re.search(r"jupyter lab (--allow-root )?book/00_preface.ipynb", dry) and '-e ".[lab]"' in dry
    assert dry.index("-m venv") < dry.index('-e ".[lab]"') < dry.index("jupyter lab")
    assert re.search(r'(?ms)^\[project.optional-dependencies\].*^lab = \["jupyterlab>=4', (ROOT / "pyproject.toml").read_text())
    assert os.path.exists(ROOT / "book" / "00_preface.ipynb")


def test_the_quick_start_in_its_own_order_leaves_the_lab_check_true(tmp_path):
    """After ``make book`` and a first ``make lab`` (their marker files in the venv, newer than what they were
    made from), a second ``make lab`` installs nothing and still opens the Preface; the check above does not
    depend on that state (it failed on a clone where ``make lab`` had run once)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for marker in (".installed", ".lab"):
        (venv / marker).touch()
    later = max((ROOT / f).stat().st_mtime for f in ("requirements.txt", "pyproject.toml")) + 10
    for marker in (".installed", ".lab"):
        os.utime(venv / marker, (later, later))
    dry = make_dry_run("lab", venv)
    assert re.search(r"jupyter lab (--allow-root )?book/00_preface.ipynb", dry)
    assert '-e ".[lab]"' not in dry and "-m venv" not in dry
    test_quick_start_opens_the_chapters_in_jupyterlab(tmp_path)


def fake_python(directory: Path, version: str) -> Path:
    """A stand-in for ``PYTHON`` that reports ``version`` and makes an (empty) venv when asked, logging its
    arguments to ``calls.log``: what an old Python would leave behind without the check."""
    path = directory / "python"
    path.write_text("#!/bin/sh\n"
                    f'echo "$@" >> "{directory}/calls.log"\n'
                    f'case "$1" in --version) echo "Python {version}";; -m) [ "$2" = venv ] && mkdir -p "$3/bin";; esac\n')
    path.chmod(0o755)
    return path


def test_a_python_older_than_3_10_is_named_before_a_venv_is_made(tmp_path):
    python, venv = fake_python(tmp_path, "3.9.18"), tmp_path / "venv"
    done = subprocess.run(["make", "setup", f"PYTHON={python}", f"VENV={venv}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=scaled_timeout(60))
    assert done.returncode != 0
    assert "Python 3.10 or newer is needed" in done.stderr and "Python 3.9.18" in done.stderr, done.stderr
    assert "ResolutionImpossible" not in done.stderr + done.stdout
    assert not venv.exists()                                                   # nothing to clean up
    assert "venv" not in (tmp_path / "calls.log").read_text()                  # it was only asked its version
    assert re.search(r'(?m)^requires-python = ">=3\.10"', (ROOT / "pyproject.toml").read_text())


def test_a_venv_left_by_an_older_python_is_named_with_the_way_out(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_python(venv / "bin", "3.9.18")
    done = subprocess.run(["make", "python-version", f"PYTHON={sys.executable}", f"VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=scaled_timeout(60))
    assert done.returncode != 0 and f"rm -rf {venv}" in done.stderr and "Python 3.9.18" in done.stderr
    ok = subprocess.run(["make", "python-version", f"PYTHON={sys.executable}", f"VENV={tmp_path / 'none'}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=scaled_timeout(60))
    assert ok.returncode == 0, ok.stderr


build_pdf = load_tool("build_pdf")


def test_make_pdf_writes_only_under_build_and_pdf_numbers_records(tmp_path):
    venv = tmp_path / "venv"
    pdf = make_dry_run("pdf", venv)
    recipe = pdf[pdf.index("jupyter-book build"):]
    assert "tools/build_pdf.py --out _build/pdf/book.pdf" in recipe
    assert "records/" not in recipe and "readme_numbers" not in recipe and "README" not in recipe
    import inspect
    assert inspect.signature(build_pdf.record).parameters["path"].default is inspect.Parameter.empty  # no default
    numbers = make_dry_run("pdf-numbers", venv)
    assert "cp _build/pdf/book.json records/pdf.json" in numbers and "readme_numbers.py --write" in numbers


def test_a_chromium_that_fails_ends_make_pdf_with_one_line_not_a_traceback(tmp_path):
    site = tmp_path / "site"
    (site / "book").mkdir(parents=True)
    (site / "book" / "00_preface.html").write_text("<html><body>x</body></html>")
    driver = tmp_path / "chromedriver"
    driver.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 1\n")
    driver.chmod(0o755)
    env = {**os.environ, "CHROMEDRIVER": str(driver), "CHROMIUM": "/bin/sh"}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "build_pdf.py"), "--site", str(site),
                           "--out", str(tmp_path / "book.pdf")], capture_output=True, text=True, env=env,
                          timeout=scaled_timeout(120))
    assert done.returncode == 1
    assert done.stderr.startswith("PDF not written: Chromium failed"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "--timeout" in done.stderr
    assert not (tmp_path / "book.pdf").exists() and not (tmp_path / "book.json").exists()


def test_the_pdf_record_counts_notebooks_as_notebooks(tmp_path):
    import json

    pdf = tmp_path / "book.pdf"
    pdf.write_bytes(b"%PDF-1.4 /Type /Pages /Type /Page /Type /Page /Type /Page")
    rec = build_pdf.record(pdf, {"typeset": 7, "seconds_to_typeset": 1.0}, tmp_path / "book.json")
    toc = (ROOT / "_toc.yml").read_text()
    entries = re.findall(r"(?m)^\s*(?:root|-\s*file):\s*(\S+)", toc)
    notebooks = [e for e in entries if (ROOT / f"{e}.ipynb").is_file()]
    assert rec["notebooks"] == len(notebooks) and rec["other_pages"] == len(entries) - len(notebooks) > 0
    assert rec["pages"] == 3 and rec["formulas"] == 7 and rec["commit"]
    assert json.loads((tmp_path / "book.json").read_text()) == rec


def test_the_quick_start_time_is_the_measured_one_and_says_what_helps():
    """The README said the snippet learns "in a few seconds on a CPU"; run as written on a shared 2-core
    machine it took minutes. Now the sentence is generated from benchmarks/bench_quickstart.py's record
    (all three OpenMP settings measured in one run) and names what helps."""
    import json

    assert "a few seconds" not in README
    block = README[README.index("<!-- numbers:quickstart -->"):README.index("<!-- /numbers:quickstart -->")]
    record = json.loads((ROOT / "benchmarks" / "results" / "bench_quickstart.json").read_text())
    seconds = record["data"]["seconds"]
    assert set(seconds) == {"as written", "OMP_WAIT_POLICY=PASSIVE", "torch.set_num_threads(1)"}
    for name, value in seconds.items():
        assert f"{value:.0f} s" in block, (name, block)
    assert "OMP_WAIT_POLICY=PASSIVE" in block and "torch.set_num_threads(1)" in block
    assert README.index("ChainedOptimizer(") < README.index("<!-- numbers:quickstart -->")


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_every_relative_link_and_image_of_the_page_exists(page):
    """The README's picture, its links to CONTRIBUTING.md, benchmarks/README.md, the API page and the rest."""
    base = (ROOT / page).parent
    targets = re.findall(r"\]\(([^)\s]+)\)", PAGES[page])
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t.split("#")[0]]
    missing = [t for t in local if not (base / t).exists()]
    assert not missing, f"{page} links to files that do not exist: {missing}"
    if page == "README.md":
        assert {"docs/chapter.png", "CONTRIBUTING.md", "benchmarks/README.md", "book/api_contract.md"} <= set(local)
        assert (ROOT / "docs" / "chapter.png").stat().st_size < 150_000   # kept small
