"""Every chapter and section page opens with what the reader will be able to do and closes with its key
takeaways (the shape the Preface promises a reader and a teacher)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
NOTEBOOKS = sorted(BOOK.glob("[0-9]*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_goals_first_and_takeaways_at_the_end(path):
    cells = json.loads(path.read_text())["cells"]
    markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    assert any("you will be able to" in s for s in markdown[:3]), "no learning goals in the first cells"
    headings = [line for s in markdown for line in s.splitlines() if line.startswith("## ")]
    assert "## Key takeaways" in headings, "no '## Key takeaways' section"
    assert headings.index("## Key takeaways") >= len(headings) // 2, "the takeaways come before the chapter's end"
