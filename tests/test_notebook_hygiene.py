"""Every notebook is listed in _toc.yml, executed top to bottom (counts 1..n), with no error output,
no stderr, and no machine-specific strings in what it stores."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
MACHINE = re.compile(r"(/tmp/|/root/|/work/|/home/\w+/|site-packages|0x[0-9a-f]{8,})")


def toc_entries():
    text = (ROOT / "_toc.yml").read_text()
    return {m.split("/")[-1] for m in re.findall(r"(?:file|root):\s*([\w/.-]+)", text)}


def test_every_notebook_is_in_the_toc_and_every_toc_entry_exists():
    assert NOTEBOOKS, "book/ holds no notebooks"
    listed = toc_entries()
    assert {nb.stem for nb in NOTEBOOKS} <= listed
    for entry in re.findall(r"(?:file|root):\s*([\w/.-]+)", (ROOT / "_toc.yml").read_text()):
        assert any((ROOT / f"{entry}{ext}").is_file() for ext in (".ipynb", ".md")), entry


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_executed_in_order_and_clean(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    asserts = 0
    for i, cell in enumerate(code, start=1):
        source = "".join(cell["source"])
        asserts += len(re.findall(r"\bassert\b|assert_close", source))
        for out in cell["outputs"]:
            assert out["output_type"] != "error", f"cell {i} stores an error"
            assert not (out["output_type"] == "stream" and out["name"] == "stderr"), f"cell {i} wrote to stderr"
            text = "".join(out.get("text", [])) + "".join(
                "".join(v) if isinstance(v, list) else str(v)
                for k, v in out.get("data", {}).items() if k.startswith("text/"))
            assert not MACHINE.search(text), f"cell {i} output holds a machine-specific string"
    assert asserts > 0, "a notebook that asserts nothing checks nothing"
