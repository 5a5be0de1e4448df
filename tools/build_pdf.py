#!/usr/bin/env python3
"""Print the whole book to one PDF: Sphinx's single-page HTML, typeset by MathJax, printed by Chromium.

``make pdf`` builds ``_build/singlehtml`` (Jupyter Book's ``--builder singlehtml``, from the stored outputs)
and then runs this script, which opens that page in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium, as the browser test does), waits until MathJax has typeset every
formula, and saves ``_build/pdf/book.pdf`` with Chromium's print-to-PDF. No LaTeX installation is needed;
the PDF looks like the web page (figures, numbered equations, code), with the sidebar hidden for print.

The script fails (exit 1) when MathJax did not finish, when a formula was left as raw TeX, or when an
image did not load, so that a PDF with raw ``\\begin{aligned}`` in it is never written silently.

    python tools/build_pdf.py [--site _build/singlehtml] [--out _build/pdf/book.pdf]
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
    args = parser.parse_args(argv)
    try:
        result = build_pdf(args.site, args.out)
    except (FileNotFoundError, RuntimeError) as err:
        print(f"PDF not written: {err}", file=sys.stderr)
        return 1
    print(f"{args.out}: {result['bytes'] / 1e6:.1f} MB; {result['typeset']} formulas typeset "
          f"in {result['seconds_to_typeset']} s")
    record(args.out, result)
    return 0


def record(pdf: Path, result: dict, path: Path = ROOT / "records" / "pdf.json") -> None:
    """Keep what the README quotes about the PDF (pages, formulas, seconds, chapters) in ``records/pdf.json``."""
    import datetime
    import json
    import os
    import re

    pages = len(re.findall(rb"/Type\s*/Page(?![a-zA-Z])", pdf.read_bytes()))
    chapters = sorted({m for m in re.findall(r"book/(\w+)", (ROOT / "_toc.yml").read_text())})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pages": pages, "formulas": result["typeset"],
                                "seconds_to_typeset": result["seconds_to_typeset"], "notebooks": len(chapters),
                                "date": datetime.date.today().isoformat(), "cores": os.cpu_count()}, indent=1) + "\n")
    print(f"{pages} pages, {result['typeset']} formulas; recorded in {path.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
