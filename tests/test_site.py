"""The built site in a real browser: every page of ``_toc.yml`` opened in headless Chromium.

Builds nothing: it serves ``_build/html`` (``make book``) on localhost from a thread and opens each page in
Debian's ``chromium`` through Selenium and Debian's ``chromedriver`` (nothing is downloaded; the browser
cannot resolve any host but localhost, so the pages must work offline). Per page: no severe console
message (JavaScript errors, failed loads), MathJax has typeset every formula without an error node, every
``<img>`` loaded with a non-zero natural size, every figure's image has alt text (its caption, not its
file name), no code or output block is wider than its box (long lines wrap; chapter 7 also in a
phone-sized window), and the repository, launch (Colab, Binder) and download
buttons are present with the URL set in ``_config.yml``. What a reader sees, at 1400 px and on a 390 px
phone (emulated, with touch): every display equation fits its box, nothing is wider than the window, no
solution or solution check shows before its drop-down is opened, no cell prints a bare return value,
every interactive figure redraws when its slider moves; on a phone a tap on either sidebar button opens
its panel, and on a desktop the contents button collapses the sidebar. Screenshots of the top of every
page at both widths go to ``_build/screenshots/<desktop|phone>/``. Also: the search page finds "Newton", and every
internal link and anchor of every built page resolves (this one needs no browser). Screenshots of two pages
go to ``_build/test-artifacts/``.

Runs with ``make site-test`` (CI, after ``make book``), which sets ``OPTBOOK_REQUIRE_SITE=1``: a missing
site, chromium, chromedriver or selenium is then a failure. ``make test`` skips the module (it does not
build the site, and an old build would be checked against new sources); ``OPTBOOK_SITE_TEST=1`` runs it
and skips, saying why, what is missing.
"""

from __future__ import annotations

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
WIDTHS = {"desktop": (1400, 900), "phone": (390, 844)}
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


@pytest.fixture(scope="module")
def browser(server):
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
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


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
    """Code and output blocks wider than their box (text cut off or behind a horizontal scroll bar)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('div.cell_input pre, div.cell_output pre, div.highlight pre'))"
        ".filter(p => p.scrollWidth > p.clientWidth + 1).map(p => p.textContent.split('\\n')[0].slice(0, 60))")


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
    problems += [f"code cut off or scrolled: {line}" for line in _overflowing_code(browser)]

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
# is wider than their box; elements that reach past the viewport (the page scrolls sideways); outputs
# visible in the Exercises section (a solution or a check of one shown before its drop-down is opened);
# Solution admonitions that are not closed drop-downs; outputs that are a bare return value (a number,
# a bool or a tuple of them, which a cell's last line prints); interactive figures.
READER_JS = r"""
const done = arguments[arguments.length - 1];
const vw = document.documentElement.clientWidth;
const visible = (el) => el.checkVisibility ? el.checkVisibility({checkVisibilityCSS: true})
                                            : el.offsetParent !== null;
const text = (el, n) => (el.textContent || '').replace(/\s+/g, ' ').trim().slice(0, n || 70);
const clips = (el) => {  // inside a box that scrolls sideways (a wide table's container, a dialog)
  for (let a = el.parentElement; a && !a.classList.contains('bd-main'); a = a.parentElement) {
    if (['auto', 'scroll'].includes(getComputedStyle(a).overflowX) || a.tagName === 'DIALOG') return true;
  }
  return false;
};
const out = {equations: [], wide: [], answers: [], closed: [], bare: [], interactive: [], small: []};
document.querySelectorAll('mjx-container[display="true"]').forEach(c => {
  const m = c.querySelector('mjx-math'); if (!m || !visible(c)) return;
  const box = c.getBoundingClientRect().width, w = m.getBoundingClientRect().width;
  if (w > box + 1) out.equations.push(`${Math.round(w)} px in ${Math.round(box)} px: ` +
    text(c.closest('.math') || c, 60));
});
document.querySelectorAll('.bd-main *').forEach(el => {
  const r = el.getBoundingClientRect(), up = el.parentElement.getBoundingClientRect();
  if (el.closest('mjx-assistive-mml') || up.right > vw + 1) return;  // report the outermost element only
  if (r.width > 0 && r.right > vw + 1 && visible(el) && !clips(el))
    out.wide.push(`${el.tagName.toLowerCase()}.${el.className || ''} to ${Math.round(r.right)} px: ${text(el, 50)}`);
});
out.wide = out.wide.slice(0, 10);
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
  const before = plot.innerHTML;
  input.value = input.value === input.max ? input.min : input.max;
  input.dispatchEvent(new Event('input', {bubbles: true}));
  if (plot.innerHTML === before) out.interactive.push(`figure ${i}: moving the slider changed nothing`);
});
document.querySelectorAll('.cell_output img').forEach(img => {  // multi-panel figures stay readable
  if (!visible(img) || !img.naturalWidth || img.naturalWidth < 1.8 * img.naturalHeight) return;
  const h = img.getBoundingClientRect().height;
  if (h < Math.min(200, img.naturalHeight) - 1)
    out.small.push(`${Math.round(h)} px tall (${img.naturalWidth} x ${img.naturalHeight}): ${img.alt.slice(0, 50)}`);
});
out.count = document.querySelectorAll('.optbook-interactive').length;
done(out);
"""


def _set_width(driver, width: str):
    """A desktop window, or a phone: its viewport (CSS pixels), as a mobile device with touch input."""
    w, h = WIDTHS[width]
    driver.set_window_size(max(w, 500), h)  # headless Chromium keeps its window at least 500 px wide
    if width == "phone":
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
    return driver.execute_async_script(READER_JS)


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page", PAGES)
def test_what_a_reader_sees(page, width, browser, server):
    """At 1400 and 390 px: equations fit, nothing is wider than the screen, no answer is shown unasked,
    no bare return value is printed, every interactive figure answers its slider, and a multi-panel figure
    is drawn at least 200 px tall (or at its own height)."""
    seen = _reader_view(browser, urljoin(server, f"{page}.html"), width, page.replace("/", "_"))
    problems = [f"display equation wider than its box, {e}" for e in seen["equations"]]
    problems += [f"wider than the {WIDTHS[width][0]} px window: {w}" for w in seen["wide"]]
    problems += [f"answer shown before it is asked for: {a}" for a in seen["answers"]]
    problems += [f"solution {c}" for c in seen["closed"]]
    problems += [f"bare return value printed: {b}" for b in seen["bare"]]
    problems += seen["interactive"]
    problems += [f"multi-panel figure too small to read: {s}" for s in seen["small"]]
    assert problems == [], f"{page} at {width} width ({len(problems)}):\n" + "\n".join(problems)


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
    page-contents button opens this page's sections, each in a panel a reader can see."""
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
