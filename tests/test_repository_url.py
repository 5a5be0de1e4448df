"""The repository URL lives in one setting, ``repository.url`` in ``_config.yml``: Jupyter Book derives the
repository, Colab and Binder buttons from it, and every notebook's install line must name the same URL.
``tools/set_repository_url.py`` rewrites both; these tests check the book is in sync and that the tool
changes only the URL."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import toc_files

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    path = ROOT / "tools" / "set_repository_url.py"
    spec = importlib.util.spec_from_file_location("set_repository_url", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def _config():
    return yaml.safe_load((ROOT / "_config.yml").read_text())


def _toc_notebooks():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [ROOT / f"{f}.ipynb" for f in toc_files(toc) if (ROOT / f"{f}.ipynb").exists()]


def _first_code_cell(path):
    nb = json.loads(path.read_text())
    return "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])


def test_config_has_repository_and_both_launch_services():
    config = _config()
    assert tool.URL_RE.match(config["repository"]["url"])
    assert tool.config_url(ROOT) == config["repository"]["url"]
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert config["launch_buttons"]["binderhub_url"] == "https://mybinder.org"
    assert config["html"]["use_repository_button"] is True


@pytest.mark.parametrize("path", _toc_notebooks(), ids=lambda p: p.stem)
def test_install_line_names_the_configured_repository(path):
    url = _config()["repository"]["url"]
    assert tool.INSTALL_SOURCE_RE.findall(_first_code_cell(path)) == [url]
    assert tool.notebook_urls(path) == [url]  # and no other copy elsewhere in the notebook


def test_every_notebook_in_book_is_in_sync():
    assert len(tool.notebooks(ROOT)) >= len(_toc_notebooks()) > 0
    assert tool.mismatches(ROOT) == []
    assert tool.main(["--check"]) == 0


def test_set_url_rewrites_config_and_install_lines_only(tmp_path):
    shutil.copy(ROOT / "_config.yml", tmp_path / "_config.yml")
    shutil.copytree(ROOT / "book", tmp_path / "book", ignore=shutil.ignore_patterns("*.bib", "*.md"))
    old = tool.config_url(tmp_path)
    before = {p.name: p.read_text() for p in (tmp_path / "book").glob("*.ipynb")}
    config_before = (tmp_path / "_config.yml").read_text()

    new = "https://github.com/a-fork/optimizers-derived"
    assert tool.main(["--root", str(tmp_path), new + ".git/"]) == 0  # normalised
    assert yaml.safe_load((tmp_path / "_config.yml").read_text())["repository"]["url"] == new
    assert tool.mismatches(tmp_path) == []
    # Only the URL changed: the same text with the old URL swapped back in, byte for byte.
    assert (tmp_path / "_config.yml").read_text().replace(new, old) == config_before
    for path in (tmp_path / "book").glob("*.ipynb"):
        text = path.read_text()
        assert text.replace(new, old) == before[path.name]
        assert json.loads(text)["cells"]  # still a notebook
    # Idempotent, and --check sees a disagreement.
    assert tool.set_url(new, tmp_path) == []
    nb = next(iter(sorted((tmp_path / "book").glob("*.ipynb"))))
    nb.write_text(nb.read_text().replace(new, old))
    assert tool.main(["--root", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize(
    "bad", ["http://github.com/a/b", "https://gitlab.com/a/b", "https://github.com/a", "github.com/a/b", ""]
)
def test_set_url_refuses_what_the_launch_buttons_cannot_use(bad, tmp_path):
    with pytest.raises(ValueError):
        tool.normalise(bad)
