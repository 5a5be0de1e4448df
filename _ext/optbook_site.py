"""Fixes to the HTML that Jupyter Book 1's stack emits (tests/test_site.py checks each in headless
Chromium).

**The harness out of the reader's view.** The notebooks double as regression tests, and their code
cells carry what only the tests need. In the rendered code (never in the notebook, which still runs as
written) :func:`reader_source` drops ``optbook.testing.assert_claim(...)`` statements, comment blocks
about nbval or ``assert_claim``, ``# pragma: no cover`` comments, and names each equation that a
comment cites by its label slug (``eq-adam-m``) by the number the reader sees (``(2.3)``). A cell left
with no code shows only its output.

**Titled notes.** ``:::{note} On a GPU`` (a title after a directive that takes none) runs the title
into the first sentence ("Note / On a GPU The processes..."); such a note becomes a note-styled
admonition with that title.

**Alt text.** myst-nb gives a figure made by a code cell the image's file name as its alt text
(``_images/8f3b....png``), which is all a screen reader announces. Every figure in the book has a caption
(set in the cell's ``mystnb.figure`` metadata), so an image whose alt text is its own file name gets the
caption of its figure instead.

**Scripts written twice**, so that a page logs no error in a browser (the test fails on any severe
console message).

Each inline ``<script>`` added after the HTML builder starts (sphinx-thebe's ``const THEBE_JS_URL = ...``,
sphinx-togglebutton's selector) is written twice, and the second ``const`` raises "Identifier
'THEBE_JS_URL' has already been declared". Sphinx 7.4 keeps such a script once with ``filename=None``
(``Sphinx.add_js_file``) and again with ``filename=''`` (``StandaloneHTMLBuilder.prepare_writing``
re-reading the registry), and the two do not compare equal; Sphinx fixed it after 7.4
(sphinx-doc/sphinx#13402), but jupyter-book 1 keeps Sphinx < 8. Here each page's script list drops the
second copy.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path


def _key(js):
    return (
        getattr(js, "filename", js) or "",
        getattr(js, "priority", None),
        tuple(sorted((getattr(js, "attributes", None) or {}).items())),
    )


def dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        key = _key(js)
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique  # the builder's own list: it restores its copy before the next page


def caption_alt_text(app, doctree, docname):
    from docutils import nodes

    for figure in doctree.findall(nodes.figure):
        captions = [c for c in figure.children if isinstance(c, nodes.caption)]
        if not captions:
            continue
        text = " ".join(captions[0].astext().split())
        for image in figure.findall(nodes.image):
            alt, uri = image.get("alt", ""), image.get("uri", "")
            if not alt or alt == uri or alt.startswith("_images/") or alt.rsplit("/", 1)[-1] == uri.rsplit("/", 1)[-1]:
                image["alt"] = text


# LaTeX that pybtex leaves in a bibliography entry's text (it renders only accents and braces): commands
# with their argument in braces already stripped (``\texttt XXT``), thin spaces, inline math.
_LATEX_TEXT = [
    (r"\\(?:texttt|textit|textbf|emph|text|mathrm|operatorname)\s*", ""),
    (r"\\,", "\u2009"),
    (r"\\propto\s*", "\u221d "),
    (r"\\max\s*", "max "),
    (r"\\min\s*", "min "),
    (r"\\times\s*", "\u00d7 "),
    (r"\\approx\s*", "\u2248 "),
    (r"\\&", "&"),
    (r"\^2\b", "\u00b2"),
    (r"\$", ""),
]


def plain_bibliography(app, doctree, docname):
    """Bibliography entries without raw LaTeX: what pybtex leaves is rewritten as plain text."""
    import re

    from docutils import nodes

    if not any(isinstance(n, nodes.citation) for n in doctree.findall(nodes.citation)):
        return
    for citation in doctree.findall(nodes.citation):
        for text in list(citation.findall(nodes.Text)):
            new = str(text)
            for pattern, repl in _LATEX_TEXT:
                new = re.sub(pattern, repl, new)
            if new != str(text):
                text.parent.replace(text, nodes.Text(new))


# --- the harness out of the reader's view -----------------------------------------------------------
_HARNESS_COMMENT = re.compile(r"nbval|assert_claim", re.I)
_PRAGMA = re.compile(r"#\s*pragma:\s*no\s*cover\b", re.I)
_SLUG = re.compile(r"\(?\b(eq-[a-z0-9]+(?:-[a-z0-9]+)*)\b\)?")


def _claim_lines(source: str) -> set[int]:
    """0-based line numbers of ``assert_claim(...)`` expression statements whose removal leaves their
    block non-empty (``ast``; IPython magics and shell lines are read as ``pass``)."""
    lines = source.split("\n")
    parsable = "\n".join(re.sub(r"^(\s*)[%!].*$", r"\1pass", line) for line in lines)
    try:
        tree = ast.parse(parsable)
    except SyntaxError:
        return set()
    drop: set[int] = set()

    # ``claim = optbook.testing.assert_claim`` names it too; such an alias line goes as well.
    def names_claim(expr):
        return (isinstance(expr, ast.Name) and expr.id in aliases) or (
            isinstance(expr, ast.Attribute) and expr.attr == "assert_claim")

    aliases = {"assert_claim"}
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.Assign) and names_claim(stmt.value):
            aliases.update(t.id for t in stmt.targets if isinstance(t, ast.Name))

    def is_claim(stmt):
        if isinstance(stmt, ast.Assign) and names_claim(stmt.value):
            return True  # the alias
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) and t.id == "_" for t in stmt.targets):
            stmt = ast.Expr(stmt.value)
        return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and names_claim(stmt.value.func))

    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list) or not body or not isinstance(body[0], ast.stmt):
                continue
            claims = [stmt for stmt in body if is_claim(stmt)]
            if claims and (len(claims) < len(body) or isinstance(node, ast.Module)):
                for stmt in claims:
                    drop.update(range(stmt.lineno - 1, stmt.end_lineno))
    return drop


def reader_source(source: str, numbers: dict[str, str] | None = None) -> str:
    """The code a reader sees for a cell's ``source`` (see the module docstring); ``numbers`` maps an
    equation label to its shown number, e.g. ``{"eq-adam-m": "(2.3)"}`` (a slug without one is kept)."""
    numbers = numbers or {}
    lines = source.split("\n")
    drop = _claim_lines(source)
    comments: dict[int, tuple[int, str]] = {}  # line -> (column, comment) for the lines kept
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT and tok.start[0] - 1 not in drop:
                comments[tok.start[0] - 1] = (tok.start[1], tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        comments = {}
    # A block of whole-line comments about the harness goes whole; so does such a trailing comment.
    full = {i for i, (col, _) in comments.items() if not lines[i][:col].strip()}
    i = 0
    while i < len(lines):
        if i in full:
            j = i
            while j + 1 in full and comments[j + 1][0] == comments[i][0]:
                j += 1
            if any(_HARNESS_COMMENT.search(comments[k][1]) for k in range(i, j + 1)):
                drop.update(range(i, j + 1))
            i = j + 1
        else:
            i += 1
    out = []
    for i, line in enumerate(lines):
        if i in drop:
            continue
        if i in comments:
            col, text = comments[i]
            if _PRAGMA.search(text) or _HARNESS_COMMENT.search(text):
                if i in full:
                    continue
                line = line[:col].rstrip()
        out.append(_SLUG.sub(lambda m: numbers.get(m.group(1), m.group(0)), line))
    # No blank line at either end, nor two in a row where something was removed.
    kept = []
    for line in out:
        if not line.strip() and (not kept or not kept[-1].strip()):
            continue
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept)


def _equation_numbers(app, env) -> dict[str, str]:
    from docutils.nodes import make_id

    math = env.get_domain("math")
    numbers = {}
    for label, (docname, number) in math.equations.items():
        if env.config.math_numfig and env.config.numfig:
            shown = env.toc_fignumbers.get(docname, {}).get("displaymath", {}).get(make_id(f"equation-{label}"))
            if not shown:
                continue
            number = ".".join(map(str, shown))
        numbers[label] = env.config.math_eqref_format.format(number=number)
    return numbers


def harness_out_of_view(app, doctree, docname):
    from docutils import nodes

    numbers = None
    for cell in list(doctree.findall(nodes.container)):
        if cell.get("nb_element") != "cell_code":
            continue
        blocks = [b for c in cell.findall(nodes.container) if c.get("nb_element") == "cell_code_source"
                  for b in c.findall(nodes.literal_block)]
        if numbers is None and _SLUG.search(cell.astext()):
            numbers = _equation_numbers(app, app.env)
        for block in list(cell.findall(nodes.literal_block)):
            old = block.astext()
            new = reader_source(old, numbers) if block in blocks else _SLUG.sub(
                lambda m: (numbers or {}).get(m.group(1), m.group(0)), old)
            if new == old:
                continue
            if new.strip():
                block.children = []
                block.append(nodes.Text(new))
                block.rawsource = new
            else:
                block.parent.remove(block)
        for source in [c for c in cell.findall(nodes.container) if c.get("nb_element") == "cell_code_source"]:
            if not any(True for _ in source.findall(nodes.literal_block)):
                source.parent.remove(source)
        if not cell.astext().strip() and not any(True for _ in cell.findall(nodes.raw)) \
                and not any(True for _ in cell.findall(nodes.image)):
            cell.parent.remove(cell)


def titled_notes(app, doctree):
    """``:::{note} Title`` (which takes no title) as a note-styled admonition titled ``Title``."""
    from docutils import nodes

    kinds = (nodes.note, nodes.tip, nodes.hint, nodes.important, nodes.warning, nodes.caution,
             nodes.attention, nodes.danger, nodes.error)
    # The titles written after such a directive in this page's source (Markdown or notebook JSON).
    try:
        raw = Path(app.env.doc2path(app.env.docname)).read_text(encoding="utf-8")
    except OSError:
        return
    names = "|".join(k.__name__ for k in kinds)
    titles = {t.strip() for t in re.findall(r"(?:[:`]{3,})\{(?:%s)\}[ \t]+([^\n\"\\]+)" % names, raw)}
    if not titles:
        return
    for note in list(doctree.findall(lambda n: isinstance(n, kinds))):
        first = note.children[0] if note.children else None
        if not isinstance(first, nodes.paragraph) or not first.children:
            continue
        # MyST keeps the directive's argument as the paragraph's first line: a Text, then a soft break
        # (a Text "\n" of its own, or the end of the same Text).
        kids = first.children
        if not isinstance(kids[0], nodes.Text):
            continue
        if "\n" in str(kids[0]):
            title, rest = str(kids[0]).split("\n", 1)
            remove = 1
        elif len(kids) > 1 and isinstance(kids[1], nodes.Text) and str(kids[1]).startswith("\n"):
            title, rest = str(kids[0]), str(kids[1])[1:]
            remove = 2
        else:
            continue
        if title.strip() not in titles:
            continue
        kind = type(note).__name__
        new = nodes.admonition("", classes=[kind, *note["classes"]], ids=note["ids"], names=note["names"])
        new += nodes.title(title.strip(), title.strip())
        del first[0:remove]
        if rest.strip():
            first.insert(0, nodes.Text(rest))
        if not first.astext().strip():
            note.remove(first)
        new.extend(note.children)
        note.replace_self(new)


def favicon_ico(app, exception):
    """``favicon.ico`` at the site's root: a browser asks for it on a page that names no icon (the
    redirect ``index.html``), and a 404 shows in its console."""
    import shutil

    if exception is None and app.builder.format == "html":
        icon = Path(app.srcdir) / "_static" / "favicon.ico"
        if icon.is_file():
            shutil.copy2(icon, Path(app.outdir) / "favicon.ico")


def student_launch_buttons(app, config):
    """In the student copy (``tools/student_build.py`` leaves ``_student.json`` at its root), the launch
    buttons open the student notebooks: the repository branch (and book path) recorded there replace
    ``_config.yml``'s, which jupyter-book passes to sphinx-book-theme as ``repository_branch`` and
    ``path_to_docs``."""
    import json

    marker = Path(app.srcdir) / "_student.json"
    if not marker.is_file():
        return
    student = json.loads(marker.read_text(encoding="utf-8"))
    options = dict(config.html_theme_options or {})
    options["repository_branch"] = student["branch"]
    options["path_to_docs"] = student.get("path_to_book", "")
    config.html_theme_options = options


def setup(app):
    app.connect("config-inited", student_launch_buttons)
    app.connect("doctree-read", titled_notes)
    app.connect("doctree-resolved", harness_out_of_view)
    app.connect("build-finished", favicon_ico)
    app.connect("doctree-resolved", caption_alt_text)
    app.connect("doctree-resolved", plain_bibliography)
    app.connect("html-page-context", dedupe_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
