#!/usr/bin/env python3
"""The README's picture of a chapter: one section of a page of the built book (``make book``), photographed
by headless Chromium (Debian's ``chromium`` and ``chromium-driver``, as the browser test uses) and saved as
a small palette PNG (256 colours) in ``docs/`` (the README shows it).

    .venv/bin/python tools/readme_screenshot.py [--page book/06_muon.html] [--figure 0]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "_build" / "html", help="the built book (_build/html)")
    parser.add_argument("--page", default="book/06_muon.html", help="page of the site (book/06_muon.html)")
    parser.add_argument("--figure", type=int, default=0, help="which figure of the page to show, at the bottom (0)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "chapter.png")
    parser.add_argument("--size", default="1200x860", help="window size in CSS pixels (1200x860)")
    args = parser.parse_args(argv)
    if not (args.site / args.page).is_file():
        print(f"no {args.site / args.page}: build the book first (make book)", file=sys.stderr)
        return 1
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(args.site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    profile = tempfile.mkdtemp(prefix="optbook-shot-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    width, height = (int(v) for v in args.size.split("x"))
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={width},{height}",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(120)
        driver.set_script_timeout(120)
        driver.get(f"http://127.0.0.1:{httpd.server_address[1]}/{args.page}")
        driver.execute_async_script("const done = arguments[arguments.length - 1];"
                                    "(window.MathJax && MathJax.startup ? MathJax.startup.promise : Promise.resolve())"
                                    ".then(() => done(true), () => done(false));")
        driver.execute_script("document.querySelectorAll('.cell_output img')[arguments[0]]"
                              ".scrollIntoView({block: 'end'}); window.scrollBy(0, 20);", args.figure)
        time.sleep(1.0)
        png = driver.get_screenshot_as_png()
    finally:
        driver.quit()
        httpd.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image.save(args.out, optimize=True)
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KiB, {image.size[0]}x{image.size[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
