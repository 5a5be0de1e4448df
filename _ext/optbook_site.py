"""Two fixes to the HTML that Jupyter Book 1's stack emits (tests/test_site.py checks both in headless
Chromium).

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


def setup(app):
    app.connect("doctree-resolved", caption_alt_text)
    app.connect("doctree-resolved", plain_bibliography)
    app.connect("html-page-context", dedupe_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
