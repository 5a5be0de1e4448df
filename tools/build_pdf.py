#!/usr/bin/env python3
"""Print the whole book to one PDF: Sphinx's single-page HTML, typeset by MathJax, printed by Chromium.

``make pdf`` builds ``_build/singlehtml`` (Jupyter Book's ``--builder singlehtml``, from the stored outputs)
and then runs this script, which opens that page in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium, as the browser test does), waits until MathJax has typeset every
formula, and saves ``_build/pdf/book.pdf`` with Chromium's print-to-PDF. No LaTeX installation is needed;
the PDF looks like the web page (figures, numbered equations, code), with the sidebar hidden for print.

The script fails (exit 1, one line naming the cause, no traceback) when MathJax did not finish, when a
formula was left as raw TeX, when an image did not load, or when Chromium or its driver gave up or could not
start, so that a PDF with raw ``\\begin{aligned}`` in it is never written silently.

It writes only under ``_build``: the PDF and, next to it, what the README quotes about it (pages, formulas,
notebooks, the commit built) in ``_build/pdf/book.json``. ``make pdf-numbers`` copies that record to
``records/pdf.json`` and rewrites the quoted numbers (``--record records/pdf.json`` here).

    python tools/build_pdf.py [--site _build/singlehtml] [--out _build/pdf/book.pdf] [--record PATH]
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", shutil.which("chromedriver") or "/usr/bin/chromedriver")

# Resolves once MathJax 3 has typeset the page; returns counts of math nodes, rendered ones and errors.
TYPESET_JS = """
const done = arguments[arguments.length - 1];
const report = (status) => {
  const nodes = Array.from(document.querySelectorAll('.math'));
  done({status: status, math: nodes.length,
        typeset: nodes.filter(n => n.querySelector('mjx-container')).length,
        errors: document.querySelectorAll('mjx-merror').length,
        broken_images: Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).length});
};
const wait = (tries) => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => report('typeset'), (e) => report('error: ' + e));
  } else if (tries > 0) {
    setTimeout(() => wait(tries - 1), 100);
  } else {
    report(window.MathJax ? 'no startup' : 'no MathJax');
  }
};
wait(300);
"""
PRINT_CSS = """
const style = document.createElement('style');
style.textContent = `
  .bd-sidebar-primary, .bd-sidebar-secondary, .bd-header, .bd-footer, .prev-next-area,
  .header-article, .bd-header-article { display: none !important; }
  .bd-main, .bd-content, .bd-article-container { max-width: 100% !important; }
  pre { white-space: pre-wrap !important; word-break: break-all; }
`;
document.head.appendChild(style);
"""


def serve(directory: Path):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def build_pdf(site: Path, out: Path, timeout: float = 600.0) -> dict:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    page = site / "book" / "00_preface.html"
    if not page.is_file():
        raise FileNotFoundError(f"no single-page build at {page} (run `make pdf`, which builds it first)")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} not found (Debian package {package})")
    # Sphinx writes the single page at the root document's path (book/00_preface.html) but with links
    # relative to the site root (_static/, _images/): serve a copy from the root so that they resolve.
    (site / "print.html").write_bytes(page.read_bytes())
    httpd = serve(site)
    profile = tempfile.mkdtemp(prefix="optbook-pdf-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-dev-shm-usage", "--no-first-run",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    # Printing a 100-page document takes Chromium minutes on 2 busy cores; Selenium's client would give
    # up after 120 s.
    driver.command_executor.client_config.timeout = int(timeout)
    try:
        driver.set_page_load_timeout(timeout)
        driver.set_script_timeout(timeout)
        start = time.perf_counter()
        driver.get(f"http://127.0.0.1:{httpd.server_address[1]}/print.html")
        result = driver.execute_async_script(TYPESET_JS)
        driver.execute_script(PRINT_CSS)
        result["seconds_to_typeset"] = round(time.perf_counter() - start, 1)
        problems = []
        if result["status"] != "typeset":
            problems.append(f"MathJax: {result['status']}")
        if result["typeset"] != result["math"] or result["errors"]:
            problems.append(f"{result['math'] - result['typeset']} formulas not typeset, {result['errors']} errors")
        if result["broken_images"]:
            problems.append(f"{result['broken_images']} images did not load")
        if problems:
            raise RuntimeError("; ".join(problems))
        pdf = driver.execute_cdp_cmd("Page.printToPDF", {
            "printBackground": True, "preferCSSPageSize": False, "paperWidth": 8.27, "paperHeight": 11.69,
            "marginTop": 0.5, "marginBottom": 0.5, "marginLeft": 0.5, "marginRight": 0.5,
            "displayHeaderFooter": True, "headerTemplate": "<span></span>",
            "footerTemplate": '<div style="font-size:8px;width:100%;text-align:center">'
                              '<span class="pageNumber"></span></div>'})
        out.parent.mkdir(parents=True, exist_ok=True)
        data = base64.b64decode(pdf["data"])
        out.write_bytes(data)
        result["bytes"] = len(data)
        return result
    finally:
        driver.quit()
        httpd.shutdown()
        shutil.rmtree(profile, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "_build" / "singlehtml")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "pdf" / "book.pdf")
    parser.add_argument("--record", type=Path, default=None,
                        help="where to write the record (default: next to --out, as .json)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds Chromium may take per stage (600)")
    args = parser.parse_args(argv)
    try:
        result = build_pdf(args.site, args.out, args.timeout)
    except (FileNotFoundError, RuntimeError) as err:
        print(f"PDF not written: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 -- Selenium's and its HTTP client's errors (a driver that did not start, a timeout)
        if type(err).__module__.split(".")[0] not in ("selenium", "urllib3"):
            raise
        message = (getattr(err, "msg", None) or str(err)).strip().splitlines()[0]
        print(f"PDF not written: Chromium failed ({type(err).__name__}: {message}). On a busy machine, "
              f"give it longer: .venv/bin/python tools/build_pdf.py --timeout {2 * args.timeout:.0f}", file=sys.stderr)
        return 1
    print(f"{args.out}: {result['bytes'] / 1e6:.1f} MB; {result['typeset']} formulas typeset "
          f"in {result['seconds_to_typeset']} s")
    record(args.out, result, args.record or args.out.with_suffix(".json"))
    return 0


def toc_pages(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """``(notebooks, other pages)`` of ``_toc.yml``: the entries that are ``.ipynb`` files and the rest
    (Markdown pages such as the appendix and the references)."""
    import re

    entries = re.findall(r"(?m)^\s*(?:root|-\s*file):\s*(\S+)", (root / "_toc.yml").read_text())
    notebooks = [e for e in entries if (root / f"{e}.ipynb").is_file()]
    return notebooks, [e for e in entries if e not in notebooks]


def record(pdf: Path, result: dict, path: Path) -> dict:
    """Write what the README quotes about the PDF (pages, formulas, seconds, notebooks and other pages of the
    table of contents, the commit built) to ``path`` (``_build/pdf/book.json``; ``records/pdf.json`` only when
    asked, by ``make pdf-numbers``)."""
    import datetime
    import json
    import os
    import re
    import subprocess

    pages = len(re.findall(rb"/Type\s*/Page(?![a-zA-Z])", pdf.read_bytes()))
    notebooks, other = toc_pages()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    rec = {"pages": pages, "formulas": result["typeset"], "seconds_to_typeset": result["seconds_to_typeset"],
           "notebooks": len(notebooks), "other_pages": len(other), "commit": commit,
           "date": datetime.date.today().isoformat(), "cores": os.cpu_count()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"{pages} pages, {result['typeset']} formulas; recorded in {path}")
    return rec


if __name__ == "__main__":
    sys.exit(main())
