"""optbook.interactive: the interactive figures' numbers are the package's, the specs are what
_static/interactive.js draws, and bad input is refused with the argument named.

The drawing itself is checked twice: here with Node.js and a minimal DOM (every spec drawn at every slider
value without a script error, each value drawing something else), and in a real browser by
tests/test_site_interactive.py (touch, keyboard, labels inside the drawing).
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import scaled_timeout

from optbook import interactive
from optbook.memory import ledger
from optbook.optim import Dion, Muon
from optbook.optim.dion import dion_rank
from optbook.polar import ns_schedule
from optbook.qk_clip import qk_clip_factors

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "records" / "capstone.json").read_text(encoding="utf-8"))


def close(a, b, rel=5e-4):  # specs keep 4 significant digits
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def test_memory_spec_is_the_ledger():
    spec = interactive.memory_spec(7e9, dps=(1, 8, 64))
    parts = [p["name"] for p in spec["parts"]]
    # bfloat16 parameters with float32 gradients: no main-gradient copy, so that part is left out
    assert parts == ["parameters", "gradients", "float32 masters", "optimizer state"]
    rows = ("params", "grads", "master", "state")
    for d, frame in zip((1, 8, 64), spec["frames"]):
        for (name, setup), bar in zip(interactive.MEMORY_SETUPS, frame["bars"]):
            book = ledger(7e9, dp=d, **setup)
            assert bar["name"] == name
            assert all(close(v, book[row].device_bytes / 1e9) for v, row in zip(bar["values"], rows)), (d, name)
    # Megatron's numbers: 18 bytes per parameter replicated, 6 + 12/d with ZeRO-1 (bf16, fp32 grads)
    replicated, zero1 = spec["frames"][2]["bars"][:2]
    assert close(sum(replicated["values"]), 18 * 7, rel=1e-5) and close(sum(zero1["values"]), (6 + 12 / 64) * 7, rel=1e-5)
    offloaded = spec["frames"][2]["bars"][2]["values"]
    assert offloaded[2:] == [0, 0]              # masters and state live on the host
    fp16 = interactive.memory_spec(7e9, dps=(1, 8), param_dtype=torch.float16, grad_dtype=torch.float16)
    assert "float32 main gradients" in [p["name"] for p in fp16["parts"]]
    assert close(fp16["frames"][1]["bars"][1]["values"][3], ledger(7e9, dp=8, optimizer="adamw", sharding="zero1",
                 param_dtype=torch.float16, grad_dtype=torch.float16)["main_grads"].device_bytes / 1e9)
    with pytest.raises(ValueError, match="params"):
        interactive.memory_spec(0)


def test_qk_clip_spec_is_qk_clip_factors():
    s = torch.tensor([200.0, 90.0, 50.0, 120.0])
    spec = interactive.qk_clip_spec(s, taus=(40.0, 100.0, 300.0), n_kv_heads=2)
    assert spec["fixed"][0]["y"] == [200.0, 90.0, 50.0, 120.0]
    for tau, frame in zip((40.0, 100.0, 300.0), spec["frames"]):
        for rule, series in zip(("group", "per_head"), frame["series"][:2]):
            q, k = qk_clip_factors(s, tau, 2, gqa_rule=rule)
            want = (s.double() * q * k.repeat_interleave(2)).tolist()
            assert all(close(a, b) for a, b in zip(series["y"], want)), (tau, rule)
            assert max(series["y"]) <= tau * (1 + 1e-6) or tau >= 200   # a clip lands every head at or below tau
        assert frame["series"][2]["y"] == [tau, tau]
    # tau = 100: the per-head rule keeps head 2 (90, below tau) but grows its query by sqrt(200/90 ... )
    q, _ = qk_clip_factors(s, 100.0, 2, gqa_rule="per_head")
    assert f"{float(q.max()):.3f}" in spec["frames"][1]["note"]
    assert spec["frames"][2]["series"][0]["y"] == spec["fixed"][0]["y"]  # above every maximum: nothing moves
    with pytest.raises(ValueError, match="max_logits"):
        interactive.qk_clip_spec(torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="n_kv_heads"):
        interactive.qk_clip_spec(s, n_kv_heads=3)


def test_newton_schulz_spec_is_the_scalar_iteration():
    """On a matrix U diag(s) V^T, Newton-Schulz maps each singular value by the schedule's polynomials:
    the spec's values (from optbook.newton_schulz on the matrix) equal the scalar iteration of ns_schedule."""
    spectrum = torch.logspace(-3, 0, 12, dtype=torch.float64)
    spec = interactive.newton_schulz_spec(spectrum, steps=4, schedules=("simple", "polar_express"))
    x0 = (spectrum / spectrum.norm()).sort(descending=True).values
    for k, frame in enumerate(spec["frames"]):
        for name, series in zip(("simple", "polar_express"), frame["series"]):
            x = x0.clone()
            for a, b, c in (ns_schedule(name, steps=k) if k else []):
                x = a * x + b * x**3 + c * x**5
            want = x.abs().sort(descending=True).values.tolist()
            assert all(close(a, b) for a, b in zip(series["y"], want)), (k, name)
    assert spec["slider"]["values"] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="spectrum"):
        interactive.newton_schulz_spec([1.0, 0.0])
    with pytest.raises(ValueError, match="shape"):
        interactive.newton_schulz_spec([1.0, 0.5], shape=(3, 4))


def test_dion_spec_is_dion_against_muon():
    spec = interactive.dion_spec(shape=(12, 16), rank_fractions=(0.25, 1.0), steps=3)
    # the first step, recomputed: same gradient for both, from zero
    gen = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(12, 12, dtype=torch.float64, generator=gen)).Q
    V = torch.linalg.qr(torch.randn(16, 12, dtype=torch.float64, generator=gen)).Q
    g = U @ torch.diag(0.9 ** torch.arange(12, dtype=torch.float64)) @ V.T \
        + 0.1 * torch.randn(12, 16, dtype=torch.float64, generator=gen)

    def first_update(opt_class, **kw):
        w = torch.zeros(12, 16, dtype=torch.float64, requires_grad=True)
        opt = opt_class([w], lr=1.0, momentum=0.95, **kw)
        w.grad = g.clone()
        opt.step()
        return -w.detach()

    muon = first_update(Muon, nesterov=False, scale_mode="none", ns_dtype=torch.float64)
    for f, frame in zip((0.25, 1.0), spec["frames"]):
        dion = first_update(Dion, rank_fraction=f, seed=0)
        cos = float((dion * muon).sum() / (dion.norm() * muon.norm()))
        assert close(frame["series"][0]["y"][0], cos), f
        r = dion_rank((12, 16), f)
        assert f"r = {r}:" in frame["note"] and f"{r * 28 / 192:.2f}" in frame["note"]
    low, full = (frame["series"][0]["y"] for frame in spec["frames"])
    assert all(a < b for a, b in zip(low, full))     # a quarter of the rank captures less of Muon's direction
    assert spec["fixed"][0]["y"] == full             # full rank, drawn in every frame
    with pytest.raises(ValueError, match="decay"):
        interactive.dion_spec(decay=0.0)


def test_capstone_spec_reads_the_record():
    spec = interactive.capstone_spec()
    assert spec["slider"]["values"] == RECORD["table_seeds"]
    target = RECORD["setup"]["target"]
    for j, frame in enumerate(spec["frames"]):
        for series, name in zip(frame["series"], RECORD["curves"]):
            curve = RECORD["curves"][name][j]
            assert series["name"] == name and series["x"] == [p[0] for p in curve]
            assert all(close(a, p[1]) for a, p in zip(series["y"], curve))
            # the readout's steps to the target are the table's steps for that seed
            assert f"{name} {RECORD['steps'][name][j]}" in frame["note"]
        assert spec["fixed"][0]["y"] == [target, target]
    with pytest.raises(ValueError, match="record"):
        interactive.capstone_spec({"curves": {}})


def test_check_spec_and_html():
    spec = interactive.qk_clip_spec([120.0, 80.0], taus=(50.0, 100.0))
    page = interactive.html(dict(spec, title="a </script> in a title"))
    assert page.startswith('<div class="optbook-interactive"><script type="application/json">')
    assert "</script> in" not in page and "<\\/script> in" in page
    for broken, field in ((dict(spec, frames=spec["frames"][:1]), "frames"), (dict(spec, kind="pie"), "kind"),
                          (dict(spec, ylim=[1, 0]), "ylim"), (dict(spec, title=""), "title")):
        with pytest.raises(ValueError, match=field):
            interactive.check_spec(broken)
    bars = interactive.memory_spec(1e9, dps=(1, 2))
    bars["frames"][0]["bars"][0]["values"].pop()
    with pytest.raises(ValueError, match="parts"):
        interactive.check_spec(bars)


# Node.js with the smallest DOM the script uses: it draws every spec at every slider value.
DOM = r"""
const fs = require('fs');
function Node(tag) { this.tagName = tag; this.children = []; this.attrs = {}; this.listeners = {};
  this.textContent = ''; this.className = ''; this.clientWidth = 0; }
Node.prototype.setAttribute = function (k, v) { this.attrs[k] = String(v); };
Node.prototype.getAttribute = function (k) { return this.attrs[k]; };
Node.prototype.appendChild = function (c) { this.children.push(c); c.parentNode = this; return c; };
Node.prototype.removeChild = function (c) { this.children.splice(this.children.indexOf(c), 1); };
Object.defineProperty(Node.prototype, 'firstChild', {get() { return this.children[0] || null; }});
Node.prototype.addEventListener = function (e, f) { (this.listeners[e] = this.listeners[e] || []).push(f); };
Node.prototype.getComputedTextLength = function () { return 7 * this.textContent.length; };
Node.prototype.getBBox = function () { return {x: +this.attrs.x || 0, width: 7 * this.textContent.length}; };
Node.prototype.all = function () { return this.children.reduce((a, c) => a.concat([c], c.all()), []); };
Node.prototype.querySelector = function (sel) {
  return this.all().find(n => sel === 'svg' ? n.tagName === 'svg' : sel === '.readout' ? n.className === 'readout'
    : sel.startsWith('script') ? n.tagName === 'script' : false) || null; };
Node.prototype.dump = function () { return this.tagName + JSON.stringify(this.attrs) + this.textContent +
  '[' + this.children.map(c => c.dump()).join(',') + ']'; };
const figures = JSON.parse(fs.readFileSync(process.argv[2], 'utf8')).map(spec => {
  const fig = new Node('div'); fig.className = 'optbook-interactive'; fig.clientWidth = +process.argv[3];
  const script = new Node('script'); script.textContent = JSON.stringify(spec); fig.appendChild(script);
  return fig; });
global.window = {addEventListener() {}};
global.document = {readyState: 'complete', createElementNS: (ns, t) => new Node(t), createElement: t => new Node(t),
  querySelectorAll: () => figures, addEventListener() {}};
require(process.argv[4]);
const out = figures.map(fig => {
  const input = fig.all().find(n => n.type === 'range'), svg = fig.querySelector('svg'), seen = new Set();
  const outside = new Set();
  for (let v = +input.min; v <= +input.max; v++) {
    input.value = v; input.listeners.input.forEach(f => f());
    seen.add(svg.dump());
    const [W, H] = svg.attrs.viewBox.split(' ').slice(2).map(Number);
    svg.all().filter(n => n.tagName === 'text' && !n.attrs.transform).forEach(t => {
      // 13 px sans-serif: about 7 px a character, or the textLength the script set to fit
      const w = t.attrs.textLength ? +t.attrs.textLength : 7 * t.textContent.length, x = +t.attrs.x;
      const lo = {middle: x - w / 2, end: x - w}[t.attrs['text-anchor']] ?? x;
      if (lo < 0 || lo + w > W || +t.attrs.y > H || +t.attrs.y < 10) outside.add(t.textContent);
    });
  }
  return {values: +input.max + 1, drawings: seen.size, readout: fig.querySelector('.readout').textContent,
          label: input.attrs['aria-label'], texts: svg.all().filter(n => n.tagName === 'text').length,
          outside: Array.from(outside)}; });
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
@pytest.mark.parametrize("width", [640, 340])
def test_script_draws_every_frame(tmp_path, width):
    specs = [interactive.memory_spec(7e9, dps=(1, 8, 64)),
             interactive.qk_clip_spec([200.0, 90.0, 50.0, 120.0], taus=(40.0, 100.0, 300.0), n_kv_heads=2),
             interactive.newton_schulz_spec(torch.logspace(-3, 0, 8, dtype=torch.float64), steps=3),
             interactive.dion_spec(shape=(12, 16), rank_fractions=(0.25, 1.0), steps=3),
             interactive.capstone_spec()]
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    (tmp_path / "dom.js").write_text(DOM)
    run = subprocess.run(["node", str(tmp_path / "dom.js"), str(tmp_path / "specs.json"), str(width),
                          str(ROOT / "_static" / "interactive.js")], capture_output=True, text=True, timeout=scaled_timeout(20))
    assert run.returncode == 0, run.stderr
    for spec, seen in zip(specs, json.loads(run.stdout)):
        assert seen["values"] == len(spec["slider"]["values"]) and seen["label"] == spec["slider"]["label"]
        assert seen["drawings"] == seen["values"], f"{spec['title']}: some slider values draw the same picture"
        assert seen["readout"].startswith(spec["slider"]["label"] + " = ") and seen["texts"] > 5
        assert seen["outside"] == [], f"{spec['title']}: labels past the drawing's edge at {width} px"
