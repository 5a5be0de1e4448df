"""The interactive figures in a real browser, by keyboard and by touch (headless Chromium, offline).

Part of the browser test (tests/test_site.py: same gate, same Debian chromium and chromedriver, nothing
downloaded). Two checks:

* A page of its own with one figure of every builder of ``optbook.interactive`` (and of each kind,
  ``lines`` and ``bars``), served from a temporary folder with ``_static/interactive.js``: at a desktop
  and a phone width (touch emulated), each figure has a slider and a drawing; the keyboard (Home, End,
  arrow keys on the focused slider) and a tap near the right end of the slider move it and redraw the
  figure; every label stays inside the drawing at every slider value; the console has no error.
  It needs no built site.
* The built site (``make book``): at least eight pages' figures are interactive figures (the browser test
  of tests/test_site.py moves and measures each of them on every page).

Runs with ``make site-test`` (``OPTBOOK_REQUIRE_SITE=1``: a missing browser fails) or ``OPTBOOK_SITE_TEST=1``.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from test_site import PAGES, WIDTHS, _set_width, chromium, site  # noqa: F401

from optbook import interactive

ROOT = Path(__file__).resolve().parents[1]
MIN_FIGURES = 8


def _specs() -> list[dict]:
    return [interactive.memory_spec(7e9),
            interactive.qk_clip_spec([200.0, 90.0, 50.0, 120.0, 30.0, 60.0, 80.0, 110.0], n_kv_heads=2),
            interactive.newton_schulz_spec(torch.logspace(-3, 0, 24, dtype=torch.float64)),
            interactive.dion_spec(shape=(16, 24), steps=10),
            interactive.capstone_spec()]


@pytest.fixture(scope="module")
def figures_page():
    """A page with one figure per builder (a numbered caption with a "Try it" sentence, as the book's
    notebooks give them), served on a free localhost port; yields its URL."""
    folder = Path(tempfile.mkdtemp(prefix="optbook-interactive-"))
    shutil.copy(ROOT / "_static" / "interactive.js", folder / "interactive.js")
    body = "".join(f'<figure>{interactive.html(spec)}<figcaption>Fig. 1.{i + 1}. {spec["title"]}. Try it: move '
                   f"the slider.</figcaption></figure>" for i, spec in enumerate(_specs()))
    (folder / "index.html").write_text(
        '<!doctype html><html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">'
        '<style>body{margin:8px;font-family:sans-serif} figure{margin:0 0 24px} '
        '.optbook-interactive svg{width:100%;height:auto;display:block}</style>'
        f'</head><body>{body}<script src="interactive.js"></script></body></html>', encoding="utf-8")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/index.html"
    httpd.shutdown()
    httpd.server_close()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def chrome():
    with chromium() as driver:
        yield driver


STATE_JS = """
const figs = Array.from(document.querySelectorAll('.optbook-interactive'));
return figs.map(fig => {
  const input = fig.querySelector('input[type=range]'), svg = fig.querySelector('svg');
  if (!input || !svg) return {missing: true};
  const edge = svg.getBoundingClientRect(), outside = [];
  svg.querySelectorAll('text').forEach(t => {
    const b = t.getBoundingClientRect();
    if (b.width && (b.left < edge.left - 0.5 || b.right > edge.right + 0.5 || b.top < edge.top - 0.5 ||
                    b.bottom > edge.bottom + 0.5)) outside.push(t.textContent);
  });
  return {missing: false, value: +input.value, max: +input.max, drawing: svg.innerHTML, outside: outside,
          readout: (fig.querySelector('.readout') || {}).textContent || '', width: Math.round(edge.width)};
});
"""


@pytest.mark.parametrize("width", ["desktop", "phone"])
def test_keyboard_and_touch_move_every_figure(chrome, figures_page, width):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    _set_width(chrome, width)
    chrome.get(figures_page)
    time.sleep(0.3)
    chrome.get_log("browser")  # the page's load is checked below, after the interaction
    start = chrome.execute_script(STATE_JS)
    assert len(start) == len(_specs()) and not any(s["missing"] for s in start), start
    inputs = chrome.find_elements(By.CSS_SELECTOR, ".optbook-interactive input[type=range]")
    problems = []
    for i, (element, before) in enumerate(zip(inputs, start)):
        chrome.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        seen = {before["drawing"]}
        for keys, want in ((Keys.END, before["max"]), (Keys.HOME, 0), (Keys.ARROW_RIGHT, 1)):
            element.send_keys(keys)
            now = chrome.execute_script(STATE_JS)[i]
            if now["value"] != want:
                problems.append(f"figure {i}: key {keys!r} left the slider at {now['value']}, not {want}")
            problems += [f"figure {i} at {now['value']}: label {t!r} outside the drawing" for t in now["outside"]]
            seen.add(now["drawing"])
        if len(seen) < 3:
            problems.append(f"figure {i}: the keyboard moved the slider but the drawing changed {len(seen) - 1} times")
        if width == "phone":  # a tap near the right end of the track moves the thumb there
            element.send_keys(Keys.HOME)
            rect = element.rect
            from selenium.webdriver.common.actions import interaction
            from selenium.webdriver.common.actions.action_builder import ActionBuilder
            from selenium.webdriver.common.actions.pointer_input import PointerInput

            finger = PointerInput(interaction.POINTER_TOUCH, "finger")
            actions = ActionBuilder(chrome, mouse=finger)
            actions.pointer_action.move_to(element, int(rect["width"] * 0.45) - 2, 0).pointer_down() \
                .pause(0.05).pointer_up()
            actions.perform()   # the offset is from the slider's centre: 95 % along the track
            time.sleep(0.1)
            now = chrome.execute_script(STATE_JS)[i]
            if now["value"] == 0:
                problems.append(f"figure {i}: a tap near the right end of the slider did not move it")
        if width == "phone" and before["width"] > WIDTHS["phone"][0]:
            problems.append(f"figure {i}: {before['width']} px wide on a {WIDTHS['phone'][0]} px phone")
    errors = [e["message"] for e in chrome.get_log("browser") if e["level"] == "SEVERE"]
    assert problems == [] and errors == [], "\n".join(problems + errors)


def test_eight_interactive_figures_in_the_book(site):  # noqa: F811 (test_site's fixture)
    count = sum((site / f"{p}.html").read_text(encoding="utf-8").count('class="optbook-interactive"')
                for p in PAGES if (site / f"{p}.html").is_file())
    assert count >= MIN_FIGURES, f"{count} interactive figures in the built book, {MIN_FIGURES} wanted"
