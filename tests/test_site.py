"""The built site in a real browser: every page of ``_toc.yml`` opened in headless Chromium.

Builds nothing: it serves ``_build/html`` (``make book``) on localhost from a thread and opens each page in
Debian's ``chromium`` through Selenium and Debian's ``chromedriver`` (nothing is downloaded; the browser
cannot resolve any host but localhost, so the pages must work offline). Per page: no severe console
message (JavaScript errors, failed loads), MathJax has typeset every formula without an error node, every
``<img>`` loaded with a non-zero natural size, every figure's image has alt text (its caption, not its
file name), no code or output block is cut off (a long line scrolls inside its box), no test harness in
the code a reader sees (``assert_claim``, nbval comments, coverage pragmas, equation-label slugs, the
cell that embeds an interactive figure), and the repository, launch (Colab, Binder) and download buttons
are present with the URL set in ``_config.yml``. What a reader sees, at 1400 px, on a 768 px tablet and on
a 390 px phone (both emulated, with touch): formulas at the size MathJax chose unless one overflows (then
scaled to fit, to no less than 80 %), nothing wider than the window, code lines never wrapped (and at
1400 px a code box holds 88 characters), no word broken in a table, figures whole (not half-hidden in a
box that scrolls sideways), unsquashed and as wide as fits (and on the phone drawn at no less than 40 % of
their 1x size, so that their text stays legible), exercise headings without a section number in front of
their own (``Exercise 18b.1``, not ``18.8.6.1. Exercise 18b.1``), no solution or solution check shown before
its drop-down is opened, no cell printing a bare return value, every interactive figure redrawn by its
slider, with a numbered caption that says what to try and every label inside the drawing. On a phone a
tap on either sidebar button opens its panel, and a pick in the page-contents panel closes it and shows
the section; on a desktop the contents button collapses the sidebar. Screenshots of the top of every
page at each width go to ``_build/screenshots/<desktop|tablet|phone>/``. Without a browser: the search
page finds "Newton"; every internal link and anchor resolves; the root page and ``/favicon.ico`` load;
a note written ``:::{note} Title`` shows its title; the rendered code drops the harness
(``reader_source``); every figure is stored at 2x and no wider than 8.5 in; and the
student site's launch buttons open the student branch. Screenshots of two pages go to
``_build/test-artifacts/``.

Runs with ``make site-test`` (CI, after ``make book``), which sets ``OPTBOOK_REQUIRE_SITE=1``: a missing
site, chromium, chromedriver or selenium is then a failure. ``make test`` skips the module (it does not
build the site, and an old build would be checked against new sources); ``OPTBOOK_SITE_TEST=1`` runs it
and skips, saying why, what is missing.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import tempfile
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest
import yaml
from helpers import scaled_timeout, toc_files

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("OPTBOOK_SITE", ROOT / "_build" / "html"))
ARTIFACTS = ROOT / "_build" / "test-artifacts"
REQUIRE = os.environ.get("OPTBOOK_REQUIRE_SITE", "") not in ("", "0")
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", shutil.which("chromedriver") or "/usr/bin/chromedriver")
SCREENSHOTS = {"book/00_preface": "preface.png", "book/06_muon": "06_muon.png"}
# What a reader sees, checked at a desktop width and at a phone's (CSS pixels, as a phone reports them).
# A screenshot of the top of every page at both widths goes to _build/screenshots/<width>/ (CI artefacts).
WIDTHS = {"desktop": (1400, 900), "tablet": (768, 1024), "phone": (390, 844)}
MOBILE = ("tablet", "phone")  # emulated as touch devices
SHOTS = ROOT / "_build" / "screenshots"
PAGE_TIMEOUT = scaled_timeout(30)  # seconds for a page's load, MathJax and images

# The browser test checks a built site, which the unit-test run (`make test`) neither builds nor keeps
# current: it runs with `make site-test` (after `make book`; CI does both), or with OPTBOOK_SITE_TEST=1.
if not REQUIRE and os.environ.get("OPTBOOK_SITE_TEST", "") in ("", "0"):
    pytest.skip("the browser test runs with `make site-test` after `make book` (or OPTBOOK_SITE_TEST=1)",
                allow_module_level=True)


def _skip(reason: str):
    if REQUIRE:
        pytest.fail(f"OPTBOOK_REQUIRE_SITE is set but {reason}", pytrace=False)
    pytest.skip(reason)


def _config():
    return yaml.safe_load((ROOT / "_config.yml").read_text())


def _toc_pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return toc_files(toc)


PAGES = _toc_pages()


@pytest.fixture(scope="module")
def site() -> Path:
    if not (SITE / "index.html").is_file():
        _skip(f"no built site at {SITE} (run `make book` first)")
    return SITE


@pytest.fixture(scope="module")
def server(site):
    """Base URL of ``site`` served by http.server on a free localhost port, from a daemon thread."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@contextlib.contextmanager
def chromium():
    """Headless Debian chromium through chromedriver, offline, in a throwaway profile (skips, saying
    why, when either or selenium is missing); also used by test_site_interactive.py."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not Path(path).is_file():
            _skip(f"{path} not found (Debian package {package}: apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _skip("selenium is not installed (it is in requirements.txt)")

    profile = tempfile.mkdtemp(prefix="optbook-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--no-proxy-server",
        # No network: every host but the local server fails to resolve, so a page that needs the
        # internet (a CDN script, a web font) shows up as a failed load in the console.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--window-size=1280,900",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager never looks for (or downloads) a driver or a browser.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(PAGE_TIMEOUT)
    driver.set_script_timeout(PAGE_TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(server):
    with chromium() as driver:
        yield driver


# Waits for MathJax 3 (the vendored copy from sphinx-mathjax-offline) to finish typesetting, then reports
# every math node Sphinx wrote, whether MathJax rendered it, and any error nodes.
MATHJAX_JS = """
const done = arguments[arguments.length - 1];
const report = (state) => {
  const nodes = Array.from(document.querySelectorAll('.math'));
  done({
    state: state,
    math: nodes.length,
    untypeset: nodes.filter(n => !n.querySelector('mjx-container')).map(n => n.textContent.slice(0, 80)),
    containers: document.querySelectorAll('mjx-container').length,
    errors: Array.from(document.querySelectorAll('mjx-merror, [data-mjx-error]'))
      .map(n => (n.getAttribute('data-mjx-error') || n.textContent).slice(0, 120)),
  });
};
const wait = (tries) => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => report('typeset'), (e) => report('error: ' + e));
  } else if (tries > 0 && document.querySelector('.math')) {
    setTimeout(() => wait(tries - 1), 100);  // the script is deferred: give it time to define MathJax
  } else {
    report(window.MathJax ? 'no startup' : 'no MathJax');
  }
};
wait(100);
"""

# Loads every image (lazy ones included) and reports those that failed or have no size.
IMAGES_JS = """
const done = arguments[arguments.length - 1];
const imgs = Array.from(document.images);
imgs.forEach(img => { img.loading = 'eager'; });
const settled = imgs.map(img => img.complete ? Promise.resolve() :
  new Promise(r => { img.addEventListener('load', r); img.addEventListener('error', r); }));
Promise.all(settled).then(() => done({
  count: imgs.length,
  bad: imgs.filter(i => !(i.complete && i.naturalWidth > 0 && i.naturalHeight > 0))
           .map(i => i.getAttribute('src')),
}));
"""


def _desktop(driver):
    """The window the per-page checks use (a test before may have emulated a phone)."""
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    driver.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": False})
    driver.set_window_size(1280, 900)


def _severe(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _open(driver, url: str):
    _severe(driver)  # drop what earlier pages logged
    driver.get(url)
    start = time.monotonic()
    while driver.execute_script("return document.readyState") != "complete":
        assert time.monotonic() - start < PAGE_TIMEOUT, f"{url} did not finish loading"
        time.sleep(0.05)


def _hrefs(driver, selector: str) -> list[str]:
    script = "return Array.from(document.querySelectorAll(arguments[0])).map(a => a.getAttribute('href'))"
    return driver.execute_script(script, selector)


def _bad_alt(driver) -> list[str]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('figure img')).map(i => i.getAttribute('alt') || '')"
        ".filter(a => a.trim().length < 10 || a.startsWith('_images/') || /\\.(png|svg|jpg)$/.test(a))")


def _overflowing_code(driver) -> list[str]:
    """Code and output blocks wider than their box that do not scroll sideways (text cut off)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('div.cell_input pre, div.cell_output pre, div.highlight pre'))"
        ".filter(p => p.scrollWidth > p.clientWidth + 1 && !['auto', 'scroll'].includes(getComputedStyle(p).overflowX))"
        ".map(p => p.textContent.split('\\n')[0].slice(0, 60))")


# What only the notebooks' tests need, in the code a reader can see (also inside closed drop-downs):
# claims asserted for the regression test, comments about nbval, coverage pragmas, equation-label slugs
# (the reader knows an equation by its number), the cell that embeds an interactive figure.
HARNESS_JS = r"""
const out = [];
const code = Array.from(document.querySelectorAll('div.cell_input pre'));
const rules = [[/assert_claim/, 'assert_claim'], [/pragma:\s*no cover/i, 'pragma: no cover'], [/nbval/i, 'nbval'],
               [/\beq-[a-z0-9]+(-[a-z0-9]+)+/, 'equation label'], [/optbook-interactive/, 'embedding cell']];
code.forEach(pre => pre.textContent.split('\n').forEach(line => rules.forEach(([re, what]) => {
  if (re.test(line)) out.push(`${what}: ${line.trim().slice(0, 80)}`);
})));
document.querySelectorAll('div.cell_output').forEach(o => (o.textContent || '').split('\n').forEach(line => {
  if (/\beq-[a-z0-9]+(-[a-z0-9]+)+/.test(line)) out.push(`equation label in an output: ${line.trim().slice(0, 80)}`);
}));
return out.slice(0, 12);
"""


@pytest.mark.parametrize("page", PAGES)
def test_page_in_browser(page, browser, server):
    _desktop(browser)
    url = urljoin(server, f"{page}.html")
    _open(browser, url)

    math = browser.execute_async_script(MATHJAX_JS)
    images = browser.execute_async_script(IMAGES_JS)

    if page in SCREENSHOTS:  # artefacts for a person to look at
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        if page != PAGES[0]:  # a chapter: show a figure and the math around it, not only the title
            browser.execute_script("const f = document.querySelector('figure, .cell_output img');"
                                   "if (f) f.scrollIntoView({block: 'center'});")
            time.sleep(0.2)
        assert browser.save_screenshot(str(ARTIFACTS / SCREENSHOTS[page]))

    problems = []  # every check runs, so one failure does not hide another
    # Console last: image loads and MathJax have run by now.
    problems += [f"console: {m}" for m in _severe(browser)]

    problems += [f"MathJax error node: {e}" for e in math["errors"]]
    problems += [f"math left as TeX ({math['state']}): {t}" for t in math["untypeset"]]
    if math["math"] and not (math["state"] == "typeset" and math["containers"] >= math["math"]):
        problems.append(f"MathJax did not typeset the page: {math}")

    problems += [f"image not loaded or of size 0: {src}" for src in images["bad"]]
    problems += [f"figure image without alt text (or only its file name): {a}" for a in _bad_alt(browser)]
    problems += [f"code cut off: {line}" for line in _overflowing_code(browser)]
    problems += [f"test harness shown to the reader, {h}" for h in browser.execute_script(HARNESS_JS)]

    repo = _config()["repository"]["url"]
    branch = _config()["repository"].get("branch", "main")
    owner_name = urlsplit(repo).path.strip("/")
    if repo not in _hrefs(browser, "a.btn-source-repository-button"):
        problems.append(f"no repository button to {repo}")
    downloads = _hrefs(browser, ".dropdown-download-buttons a.btn-download-source-button")
    if (ROOT / page).with_suffix(".ipynb").exists():  # launch buttons are for notebooks only
        if downloads != [f"{'../' * page.count('/')}_sources/{page}.ipynb"]:
            problems.append(f"download button: {downloads}")
        launch = _hrefs(browser, ".dropdown-launch-buttons a")
        colab = f"https://colab.research.google.com/github/{owner_name}/blob/{branch}/{page}.ipynb"
        if colab not in launch:
            problems.append(f"no Colab button to {colab}: {launch}")
        binder = [h for h in launch if h.startswith(f"https://mybinder.org/v2/gh/{owner_name}/{branch}?")]
        if not (len(binder) == 1 and binder[0].endswith(f"/{page}.ipynb")):
            problems.append(f"no Binder button to {owner_name}@{branch} {page}.ipynb: {launch}")
    elif len(downloads) != 1:
        problems.append(f"download button: {downloads}")
    assert problems == [], f"{page}:\n" + "\n".join(problems)


# What the reader sees at one width, after MathJax has typeset the page: display equations whose content
# is wider than their box although not scaled down to the 80 % floor; formulas not at the size MathJax
# chose (reader.js may shrink only one that overflows, and to no less than 80 %); elements that reach past
# the viewport (the page scrolls sideways); code lines that wrap (a line drawn on several rows), and at
# the desktop width code boxes too narrow for 88 characters; words broken inside a table; figures
# shown in part (inside a box that scrolls sideways) or narrower than what fits, and on the phone figures
# drawn below PHONE_MIN_SCALE of their 1x width (a 10 pt tick label, 13.9 px at 1x, would fall below
# 5.6 px: too wide a figure, or three panels side by side, which must be stacked in rows); exercise
# headings whose section number shows ("18.8.6.1. Exercise 18b.1"); outputs visible in the
# Exercises section (a solution or a check of one shown before its drop-down is opened); Solution
# admonitions that are not closed drop-downs; outputs that are a bare return value (a number, a bool or a
# tuple of them, which a cell's last line prints); interactive figures (slider, numbered caption that
# says what to try, every label inside the drawing).
READER_JS = r"""
const width = arguments[0];
const done = arguments[arguments.length - 1];
const vw = document.documentElement.clientWidth;
const visible = (el) => el.checkVisibility ? el.checkVisibility({checkVisibilityCSS: true})
                                            : el.offsetParent !== null;
const text = (el, n) => (el.textContent || '').replace(/\s+/g, ' ').trim().slice(0, n || 70);
const scrolls = (el) => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
const clips = (el) => {  // inside a box that scrolls sideways (a wide table's container, a dialog)
  for (let a = el.parentElement; a && !a.classList.contains('bd-main'); a = a.parentElement) {
    if (scrolls(a) || a.tagName === 'DIALOG') return true;
  }
  return false;
};
const out = {equations: [], math: [], wide: [], answers: [], closed: [], bare: [], interactive: [],
             wrapped: [], narrow: [], broken: [], figures: [], headings: []};
const MIN = 0.8;
const PHONE_MIN_SCALE = 0.40;  // FIGURE_MAX_WIDTH's 850 px fit at 41 % in the phone's 347 px column
const items = [];
try { for (const item of MathJax.startup.document.math) items.push(item); } catch (e) { /* no math */ }
const outputScale = (window.MathJax && MathJax.startup && MathJax.startup.output &&
                     MathJax.startup.output.options.scale) || 1;
items.forEach(item => {
  const c = item.typesetRoot, m = c && c.querySelector('mjx-math');
  if (!m || !c.isConnected || !visible(c) || !item.metrics) return;
  const chosen = item.metrics.scale * outputScale;  // MathJax's size, relative to the surrounding text
  const actual = parseFloat(getComputedStyle(c).fontSize) / parseFloat(getComputedStyle(c.parentElement).fontSize);
  const display = c.getAttribute('display') === 'true';
  const column = display ? c : (c.parentElement.closest('p, li, dd, td, div, figcaption') || c.parentElement);
  const room = column.getBoundingClientRect().width, need = m.getBoundingClientRect().width * chosen / actual;
  const what = text(c.closest('.math') || c.parentElement, 50);
  if (actual < MIN * chosen - 0.005)
    out.math.push(`at ${Math.round(100 * actual / chosen)} % of MathJax's size: ${what}`);
  else if (actual < 0.99 * chosen && need <= room + 1)
    out.math.push(`shrunk to ${Math.round(100 * actual / chosen)} % although it fits at MathJax's size ` +
                  `(${Math.round(need)} px in ${Math.round(room)} px): ${what}`);
  if (display && m.getBoundingClientRect().width > c.getBoundingClientRect().width + 1 && actual > MIN * chosen + 0.01)
    out.equations.push(`${Math.round(m.getBoundingClientRect().width)} px in ${Math.round(c.getBoundingClientRect().width)} px ` +
                       `at ${Math.round(100 * actual / chosen)} %: ${what}`);
});
document.querySelectorAll('.bd-main *').forEach(el => {
  const r = el.getBoundingClientRect(), up = el.parentElement.getBoundingClientRect();
  if (el.closest('mjx-assistive-mml') || up.right > vw + 1) return;  // report the outermost element only
  if (r.width > 0 && r.right > vw + 1 && visible(el) && !clips(el))
    out.wide.push(`${el.tagName.toLowerCase()}.${el.className || ''} to ${Math.round(r.right)} px: ${text(el, 50)}`);
});
out.wide = out.wide.slice(0, 10);
document.querySelectorAll('div.cell_input pre, div.cell_output pre, div.highlight pre').forEach(pre => {
  if (!visible(pre)) return;
  const cs = getComputedStyle(pre), lines = pre.textContent.replace(/\n+$/, '').split('\n');
  const row = parseFloat(cs.lineHeight) || 1.25 * parseFloat(cs.fontSize);
  const h = pre.scrollHeight - parseFloat(cs.paddingTop) - parseFloat(cs.paddingBottom);
  if (h > (lines.length + 0.5) * row)
    out.wrapped.push(`${lines.length} lines drawn on ${Math.round(h / row)} rows: ${lines[0].trim().slice(0, 50)}`);
  const longest = Math.max(...lines.map(l => l.length));
  if (width === 'desktop' && pre.closest('div.cell_input') && longest <= 88 && pre.scrollWidth > pre.clientWidth + 1)
    out.narrow.push(`${longest} characters scroll in a ${pre.clientWidth} px box: ${lines[0].trim().slice(0, 50)}`);
});
out.wrapped = out.wrapped.slice(0, 10);
document.querySelectorAll('.bd-article table').forEach(table => {  // a word drawn on two rows
  if (!visible(table)) return;
  const walker = document.createTreeWalker(table, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest('mjx-container')) continue;
    const word = /[\p{L}\p{N}_]{2,}/gu;
    for (let m = word.exec(node.data); m; m = word.exec(node.data)) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const rows = new Set(Array.from(range.getClientRects()).filter(q => q.width > 0).map(q => Math.round(q.top)));
      if (rows.size > 1) { out.broken.push(`"${m[0]}" in: ${text(table, 50)}`); return; }
    }
  }
});
document.querySelectorAll('.bd-article img').forEach(img => {  // the whole picture, as wide as fits
  if (!visible(img) || !img.naturalWidth) return;
  for (let a = img.parentElement; a && !a.classList.contains('bd-article'); a = a.parentElement) {
    if (scrolls(a) && a.scrollWidth > a.clientWidth + 1) {
      out.figures.push(`in a box that scrolls sideways, ${Math.round(100 * a.clientWidth / a.scrollWidth)} % ` +
                       `of it shown: ${img.alt.slice(0, 50)}`);
      return;
    }
  }
  const box = img.parentElement, cs = getComputedStyle(box);
  const room = box.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
  // its own width: the width myst-nb writes (a 2x PNG's 1x size), else its pixels
  const own = parseFloat(img.getAttribute('width')) || parseFloat(img.style.width) || img.naturalWidth;
  const w = img.getBoundingClientRect().width;
  const h = img.getBoundingClientRect().height, ratio = img.naturalWidth / img.naturalHeight;
  if (h > 0 && Math.abs(w / h / ratio - 1) > 0.03)
    out.figures.push(`squashed: ${Math.round(w)} x ${Math.round(h)} px for a ${img.naturalWidth} x ` +
                     `${img.naturalHeight} image: ${img.alt.slice(0, 50)}`);
  if (w < Math.min(own, room) - 2)
    out.figures.push(`${Math.round(w)} px wide where ${Math.round(Math.min(own, room))} px fit: ${img.alt.slice(0, 50)}`);
  if (width === 'phone' && w < PHONE_MIN_SCALE * own - 0.5)
    out.figures.push(`drawn at ${Math.round(100 * w / own)} % of its ${Math.round(own)} px width on the phone ` +
                     `(at least ${Math.round(100 * PHONE_MIN_SCALE)} %: narrower, or panels in rows): ` +
                     img.alt.slice(0, 50));
});
document.querySelectorAll('.bd-article section[id^="exercise-"] > :is(h2, h3, h4)').forEach(h => {
  const number = h.querySelector('.section-number');
  if (number && visible(number) && number.getBoundingClientRect().width > 0)
    out.headings.push(text(h, 60));
});
const exercises = document.querySelector('section#exercises, section[id^="exercises"]');
if (exercises) exercises.querySelectorAll('.cell_output').forEach(o => {
  if (visible(o) && text(o)) out.answers.push('output: ' + text(o));
});
document.querySelectorAll('.admonition').forEach(a => {
  const title = a.querySelector('.admonition-title');
  if (!title || !/^Solutions?\b/.test(text(title))) return;
  const body = Array.from(a.children).filter(c => !c.classList.contains('admonition-title'));
  if (!a.classList.contains('dropdown')) out.closed.push('not a drop-down: ' + text(title));
  else if (body.some(visible)) out.closed.push('open before a click: ' + text(title));
});
document.querySelectorAll('.cell_output .output.text_plain').forEach(o => {  // the pre: not the copy button
  if (/^[\s(\[]*([-+]?(\d[\d_,]*\.?\d*|\.\d+)(e[-+]?\d+)?|True|False|None|nan|inf)([\s,)\]]*([-+]?(\d[\d_,]*\.?\d*)(e[-+]?\d+)?|True|False|nan|inf))*[\s,)\]]*$/i
      .test((o.querySelector('pre') || o).textContent)) out.bare.push(text(o.querySelector('pre') || o));
});
document.querySelectorAll('.optbook-interactive').forEach((fig, i) => {
  const input = fig.querySelector('input[type=range]'), plot = fig.querySelector('svg');
  if (!input || !plot) { out.interactive.push(`figure ${i}: no slider or no plot`); return; }
  const caption = fig.closest('figure') && fig.closest('figure').querySelector('figcaption');
  if (!caption || !/^Fig\.\s*\d+\.\d+/.test(text(caption, 400)) || !/\bslider\b/i.test(text(caption, 400)))
    out.interactive.push(`figure ${i}: no numbered caption that says what to try with the slider: ` +
                         (caption ? text(caption) : 'no caption'));
  const before = plot.innerHTML;
  for (const value of [input.max, input.min]) {
    input.value = value;
    input.dispatchEvent(new Event('input', {bubbles: true}));
    const edge = plot.getBoundingClientRect();  // on the screen: rotated labels included
    plot.querySelectorAll('text').forEach(t => {
      const b = t.getBoundingClientRect();
      if (b.width && (b.left < edge.left - 0.5 || b.right > edge.right + 0.5 || b.top < edge.top - 0.5 ||
                      b.bottom > edge.bottom + 0.5))
        out.interactive.push(`figure ${i}: "${t.textContent}" runs past the drawing's edge`);
    });
  }
  if (plot.innerHTML === before) out.interactive.push(`figure ${i}: moving the slider changed nothing`);
});
out.interactive = Array.from(new Set(out.interactive));
out.count = document.querySelectorAll('.optbook-interactive').length;
done(out);
"""


def _set_width(driver, width: str):
    """A desktop window, or a phone: its viewport (CSS pixels), as a mobile device with touch input."""
    w, h = WIDTHS[width]
    driver.set_window_size(max(w, 500), h)  # headless Chromium keeps its window at least 500 px wide
    if width in MOBILE:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": True})
        driver.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": True, "maxTouchPoints": 5})
    else:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        driver.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": False})


def _reader_view(driver, url: str, width: str, name: str) -> dict:
    _set_width(driver, width)
    _open(driver, url)
    driver.execute_async_script(MATHJAX_JS)
    time.sleep(0.1)  # MathJax's own resize handling and the page's scripts after typesetting
    (SHOTS / width).mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / width / f"{name}.png"))
    return driver.execute_async_script(READER_JS, width)


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page", PAGES)
def test_what_a_reader_sees(page, width, browser, server):
    """At 1400, 768 and 390 px: formulas at MathJax's size unless they overflow (then no less than 80 %),
    nothing wider than the screen, code lines never wrapped (at 1400 px a code box holds 88 characters),
    table words never broken, figures whole and as wide as fits (on the phone at no less than 40 % of their
    1x width), exercise headings without a section number, no answer shown unasked, no bare return
    value printed, every interactive figure answers its slider and has a numbered caption."""
    seen = _reader_view(browser, urljoin(server, f"{page}.html"), width, page.replace("/", "_"))
    problems = [f"display equation wider than its box, {e}" for e in seen["equations"]]
    problems += [f"formula {m}" for m in seen["math"][:10]]
    problems += [f"wider than the {WIDTHS[width][0]} px window: {w}" for w in seen["wide"]]
    problems += [f"code line wrapped: {c}" for c in seen["wrapped"]]
    problems += [f"code box narrower than 88 characters: {c}" for c in seen["narrow"]]
    problems += [f"word broken in a table: {b}" for b in seen["broken"]]
    problems += [f"figure {f}" for f in seen["figures"]]
    problems += [f"exercise heading with a section number in front: {h}" for h in seen["headings"]]
    problems += [f"answer shown before it is asked for: {a}" for a in seen["answers"]]
    problems += [f"solution {c}" for c in seen["closed"]]
    problems += [f"bare return value printed: {b}" for b in seen["bare"]]
    problems += seen["interactive"]
    assert problems == [], f"{page} at {width} width ({len(problems)}):\n" + "\n".join(problems)


def test_index_and_favicon(browser, server):
    """The site's root page (a redirect to the preface) loads without a console error, and
    /favicon.ico, which a browser asks for on a page that names no icon, is there."""
    from urllib.request import urlopen

    _desktop(browser)
    _open(browser, server)
    time.sleep(0.5)  # the redirect
    assert _severe(browser) == []
    with urlopen(urljoin(server, "favicon.ico")) as response:
        assert response.status == 200 and response.read(4) == b"\x00\x00\x01\x00"  # an ICO file


def test_titled_notes(site):
    """A note written ``:::{note} On a GPU`` shows "On a GPU" as its title, separate from its body
    (it ran into the first sentence under a title "Note": "On a GPU The processes...")."""
    import re

    wrong, checked = [], 0
    for page in PAGES:
        source = next((ROOT / page).parent.glob(Path(page).name + ".*"), None)
        if source is None or source.suffix not in (".ipynb", ".md"):
            continue
        titles = re.findall(r"[:`]{3,}\{(?:note|tip|hint|important|warning|caution|attention|danger|error)\}"
                            r"[ \t]+([^\n\"\\]+)", source.read_text(encoding="utf-8"))
        html = (site / f"{page}.html").read_text(encoding="utf-8")
        for title in titles:
            checked += 1
            if f'<p class="admonition-title">{title.strip()}</p>' not in html:
                wrong.append(f"{page}: {title.strip()!r}")
    assert checked >= 7 and wrong == [], f"{checked} titled notes; without their title: {wrong}"


def _site_extension():
    import importlib.util

    spec = importlib.util.spec_from_file_location("optbook_site", ROOT / "_ext" / "optbook_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reader_source():
    """What the rendered page shows of a code cell: claims, comments about the harness and pragmas go,
    equation labels become numbers, and the rest stays as written (an IPython magic included)."""
    source = (
        "# Exact results are compared by nbval; the rest\n"
        "# is asserted with optbook.testing.assert_claim.\n"
        "claim = optbook.testing.assert_claim\n"
        "try:\n"
        "    import optbook\n"
        "except ImportError:  # pragma: no cover\n"
        "    %pip install optbook\n"
        "x = 2.0  # from (eq-adam-m) and eq-adam-v\n"
        "claim(\"x is two\", x, \"==\", 2.0)\n"
        "_ = optbook.testing.assert_claim(\"x > 1\",\n"
        "                                 x, \">\", 1.0)\n"
        "for k in range(2):\n"
        "    assert_claim(\"k\", k, \">=\", 0)  # kept: the loop needs a body\n"
        "print(x)  # checked by nbval\n")
    assert _site_extension().reader_source(source, {"eq-adam-m": "(2.3)"}) == (
        "try:\n"
        "    import optbook\n"
        "except ImportError:\n"
        "    %pip install optbook\n"
        "x = 2.0  # from (2.3) and eq-adam-v\n"
        "for k in range(2):\n"
        "    assert_claim(\"k\", k, \">=\", 0)  # kept: the loop needs a body\n"
        "print(x)")


# 8.5 in at the book's 100 dpi: in a 390 px phone's 347 px column such a figure is drawn at 41 % of its
# size, its 10 pt labels at 5.7 CSS px (17 device pixels on a 3x screen, from the 2x image): about the
# most a figure can lose and stay readable. The browser test's PHONE_MIN_SCALE (40 %) measures it on the
# page itself.
FIGURE_MAX_WIDTH = 850


def _stored_figures(page):
    """(PNG width, PNG height, width shown, height shown) of every stored matplotlib figure of a page."""
    import base64
    import json
    import struct

    path = (ROOT / page).with_suffix(".ipynb")
    if not path.exists():
        return []
    sizes = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                width, height = struct.unpack(">II", base64.b64decode("".join(png))[16:24])
                shown = output.get("metadata", {}).get("image/png", {})
                sizes.append((width, height, shown.get("width", width), shown.get("height", height)))
    return sizes


def test_figures_at_2x():
    """Every matplotlib figure of every notebook is stored at twice its display size (PNG
    pixels = 2 x the width and height in its output metadata, which the page uses), so that it is sharp
    on a phone's screen and under zoom."""
    wrong = []
    for page in PAGES:
        sizes = _stored_figures(page)
        at_2x = [abs(w - 2 * sw) <= 2 and abs(h - 2 * sh) <= 2 for w, h, sw, sh in sizes]
        if not all(at_2x):
            wrong.append(f"{page}: {at_2x.count(False)} of {len(sizes)} figures at 1x")
    assert wrong == [], "\n".join(wrong)


def test_figures_fit_a_phone():
    """Every stored figure of every notebook is at most FIGURE_MAX_WIDTH pixels wide at 1x
    (8.5 in at 100 dpi; a figure of three or more panels side by side is restacked in rows to get there),
    so that in a 390 px phone's 347 px column it is drawn at no less than 41 % of its size. Without a browser: the
    browser test measures the same thing on the built page."""
    wrong = []
    for page in PAGES:
        wide = [shown_w for _, _, shown_w, _ in _stored_figures(page) if shown_w > FIGURE_MAX_WIDTH]
        if wide:
            wrong.append(f"{page}: figures {wide} px wide at 1x (at most {FIGURE_MAX_WIDTH})")
    assert wrong == [], "\n".join(wrong)


STUDENT_SITE = ROOT / "_build" / "student" / "_build" / "html"


def test_student_launch_buttons():
    """The student site's Colab and Binder buttons open the student notebooks: book/<page>.ipynb on the
    branch tools/student_build.py names, never the full notebooks of the book's own branch."""
    import importlib.util

    if not (STUDENT_SITE / "book" / "02_adam.html").is_file():
        _skip(f"no student site at {STUDENT_SITE} (run `make student` first)")
    spec = importlib.util.spec_from_file_location("student_build", ROOT / "tools" / "student_build.py")
    student_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(student_build)
    repo = _config()["repository"]
    owner_name = urlsplit(repo["url"]).path.strip("/")
    branch = student_build.BRANCH
    assert branch != repo.get("branch", "main")
    wrong, checked = [], 0
    for page in PAGES:
        if not (ROOT / page).with_suffix(".ipynb").exists():
            continue
        links = _parse(STUDENT_SITE / f"{page}.html").links
        colab = f"https://colab.research.google.com/github/{owner_name}/blob/{branch}/{page}.ipynb"
        binder = f"https://mybinder.org/v2/gh/{owner_name}/{branch}?urlpath=tree/{page}.ipynb"
        checked += 1
        for want in (colab, binder):
            if want not in links:
                wrong.append(f"{page}: no {want}; launch links: {[l for l in links if 'colab' in l or 'binder' in l]}")
    assert checked > 10 and wrong == [], "\n".join(wrong[:10])


def test_interactive_figures(site):
    """At least three figures with a slider, in the pages (the browser test moves each one)."""
    pages = [p for p in PAGES if "optbook-interactive" in (site / f"{p}.html").read_text(encoding="utf-8")]
    assert len(pages) >= 3, f"interactive figures on {pages}"


def _tap(driver, element):
    """A touch tap (pointer type touch), as a phone delivers it."""
    from selenium.webdriver.common.actions.action_builder import ActionBuilder
    from selenium.webdriver.common.actions.pointer_input import PointerInput
    from selenium.webdriver.common.actions import interaction

    finger = PointerInput(interaction.POINTER_TOUCH, "finger")
    actions = ActionBuilder(driver, mouse=finger)
    actions.pointer_action.move_to(element).pointer_down().pause(0.05).pointer_up()
    actions.perform()


_VISIBLE_BUTTONS = ("return Array.from(document.querySelectorAll(arguments[0]))"
                    ".filter(b => b.checkVisibility({checkVisibilityCSS: true}) && b.getBoundingClientRect().width > 0)")


@pytest.mark.parametrize("page", ["book/02_adam", "book/06_muon"])
def test_navigation_on_a_phone(page, browser, server):
    """At 390 px a tap on the visible contents button opens the book's contents, and a tap on the
    page-contents button opens this page's sections, each in a panel a reader can see; a tap on a
    section there closes the panel and shows that section."""
    _set_width(browser, "phone")
    problems = []
    for button, panel, link in (("primary-toggle", "pst-primary-sidebar-modal", "nav.bd-docs-nav a"),
                                ("secondary-toggle", "pst-secondary-sidebar-modal", "a.nav-link")):
        _open(browser, urljoin(server, f"{page}.html"))
        buttons = browser.execute_script(_VISIBLE_BUTTONS, f".{button}")
        if len(buttons) != 1:
            problems.append(f".{button}: {len(buttons)} visible buttons")
            continue
        _tap(browser, buttons[0])
        time.sleep(0.4)
        state = browser.execute_script(
            "const d = document.getElementById(arguments[0]);"
            "const links = d ? Array.from(d.querySelectorAll(arguments[1]))"
            "  .filter(a => a.checkVisibility({checkVisibilityCSS: true}) && a.getBoundingClientRect().width > 0) : [];"
            "return {open: !!(d && d.open), links: links.length}", panel, link)
        if not (state["open"] and state["links"] >= 2):
            problems.append(f"tap on .{button}: panel #{panel} {state}")
            continue
        if button == "secondary-toggle":  # pick the last section: the panel closes and the section shows
            target = browser.execute_script(
                "const links = Array.from(document.getElementById(arguments[0]).querySelectorAll(arguments[1]))"
                "  .filter(a => a.checkVisibility({checkVisibilityCSS: true}) && a.getBoundingClientRect().width > 0);"
                "return links[links.length - 1]", panel, link)
            href = target.get_attribute("href")
            _tap(browser, target)
            time.sleep(0.6)
            after = browser.execute_script(
                "const d = document.getElementById(arguments[0]);"
                "const s = document.getElementById(decodeURIComponent(location.hash.slice(1)));"
                "return {open: !!(d && d.open), hash: location.hash,"
                "        top: s ? Math.round(s.getBoundingClientRect().top) : null}", panel)
            if after["open"] or not href.endswith(after["hash"] or "#?") or after["top"] is None \
                    or not -5 <= after["top"] <= WIDTHS["phone"][1] / 2:
                problems.append(f"after picking {href} in #{panel}: {after}")
    assert problems == [], "\n".join(problems)


def test_sidebar_collapses_on_a_desktop(browser, server):
    """At 1400 px the visible contents button hides the book's contents and shows them again."""
    _set_width(browser, "desktop")
    _open(browser, urljoin(server, "book/02_adam.html"))
    shown = "return document.getElementById('pst-primary-sidebar').checkVisibility({checkVisibilityCSS: true})"
    assert browser.execute_script(shown)
    buttons = browser.execute_script(_VISIBLE_BUTTONS, ".primary-toggle")
    assert len(buttons) == 1, f"{len(buttons)} visible contents buttons"
    buttons[0].click()
    time.sleep(0.6)
    assert not browser.execute_script(shown), "the contents are still shown after a click"
    assert browser.execute_script("return !document.getElementById('pst-primary-sidebar-modal').open")
    buttons[0].click()
    time.sleep(0.6)
    assert browser.execute_script(shown), "the contents do not come back after a second click"


def test_search_finds_newton(browser, server):
    _desktop(browser)
    _open(browser, urljoin(server, "search.html?q=Newton"))
    start = time.monotonic()
    hits: list[str] = []
    while time.monotonic() - start < PAGE_TIMEOUT:
        summary = browser.execute_script(
            "const s = document.querySelector('#search-results .search-summary, #search-results p');"
            "return s ? s.textContent : ''"
        )
        hits = _hrefs(browser, "#search-results ul.search li a")
        if hits and summary.strip():
            break
        time.sleep(0.1)
    assert any("05_newton_schulz.html" in h for h in hits), f"search for Newton found {hits}"
    assert _severe(browser) == []


class _Links(HTMLParser):
    """Collects ids/names (anchors) and the href/src of links in one HTML page."""

    def __init__(self):
        super().__init__()
        self.anchors: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key):
                self.anchors.add(attrs[key])
        if tag in ("a", "link") and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag in ("img", "script") and attrs.get("src"):
            self.links.append(attrs["src"])


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser


def test_internal_links_resolve(site):
    """Every local href/src of every built page names an existing file, and every #anchor an id in it."""
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)
    assert len(pages) >= len(PAGES)
    broken, checked = [], 0
    for page in pages:
        for link in _parse(page).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue  # external: not checked (no network here)
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            where = f"{page.relative_to(site)}: {link}"
            if not target.is_file() or site.resolve() not in target.resolve().parents:
                broken.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in _parse(target).anchors:
                    broken.append(f"{where} (no anchor #{parts.fragment})")
    assert checked > 100, f"only {checked} internal links found: is {site} a full build?"
    assert broken == [], "\n".join(broken)
