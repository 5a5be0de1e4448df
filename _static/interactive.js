/* Figures with a slider, drawn from data computed when the notebook ran (no kernel, no network).

A notebook cell writes
  <div class="optbook-interactive"><script type="application/json">{...}</script></div>
with the JSON
  {"title": str, "xlabel": str, "ylabel": str, "xlog": bool, "ylog": bool,
   "xlim": [lo, hi], "ylim": [lo, hi], "x": [...],            (x shared by every curve)
   "slider": {"label": str, "values": [...], "initial": index},
   "frames": [{"series": [{"name": str, "y": [...], "color": "#rrggbb", "dash": bool}],
               "note": str}, ...],                             (one frame per slider value)
   "fixed": [series drawn in every frame]}
and this script draws it as an SVG with a range input; moving the slider redraws the curves of that
frame. A series may have its own "x", and "markers": true draws its points as dots without a line (for a
category on the x axis; hollow dots when "dash" is set).
With "kind": "bars" the figure is horizontal stacked bars instead:
  {"kind": "bars", "title": str, "xlabel": str, "xlim": [0, hi],
   "parts": [{"name": str, "color": "#rrggbb"}, ...],            (the segments of every bar, in order)
   "slider": {...},
   "frames": [{"bars": [{"name": str, "values": [one per part]}], "note": str}, ...]}
The legend sits under the plot, clear of the data. Printing (the PDF) shows the initial frame. The
slider is a native range input: arrow keys, Page Up/Down, Home and End move it, and so does a finger.
The specs are built by optbook.interactive (src/optbook/interactive.py), which checks them.
*/
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  // The drawing is as many units wide as the figure has CSS pixels (640 at most, 340 at least), so its
  // 13-unit labels stay about 13 px tall on a phone too instead of shrinking with a 640-unit drawing.
  var W = 640, H = 360, M = {l: 64, r: 16, t: 30, b: 46};

  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  function scale(lim, log, a, b) {
    var f = log ? Math.log10 : function (v) { return v; };
    var lo = f(lim[0]), hi = f(lim[1]);
    return function (v) { return a + (f(v) - lo) / (hi - lo) * (b - a); };
  }

  function ticks(lim, log) {
    var out = [];
    if (log) {
      for (var e = Math.ceil(Math.log10(lim[0]) - 1e-9); e <= Math.floor(Math.log10(lim[1]) + 1e-9); e++) {
        out.push(Math.pow(10, e));
      }
      return out;
    }
    var span = lim[1] - lim[0], step = Math.pow(10, Math.floor(Math.log10(span / 5)));
    [1, 2, 5, 10].some(function (m) { if (span / (m * step) <= 6) { step *= m; return true; } return false; });
    for (var v = Math.ceil(lim[0] / step - 1e-9) * step; v <= lim[1] + 1e-9 * span; v += step) {
      out.push(Math.abs(v) < 1e-12 * span ? 0 : v);
    }
    return out;
  }

  function label(v, log) {
    if (log) {
      var e = Math.round(Math.log10(v));
      return e >= -2 && e <= 3 ? String(Math.pow(10, e)) : "1e" + e;
    }
    return String(+v.toPrecision(6));
  }

  // A label at either end of the x axis is moved inward until it lies inside the drawing (the last
  // tick's label, centred on the plot's right edge, was cut off by the SVG's border).
  function keepInside(text) {
    var box;
    try { box = text.getBBox(); } catch (e) { return; }
    if (!box.width) return;
    var x = +text.getAttribute("x");
    if (box.x + box.width > W - 1) text.setAttribute("x", x - (box.x + box.width - (W - 1)));
    else if (box.x < 1) text.setAttribute("x", x + 1 - box.x);
  }

  function fitTitle(title) {
    try {  // a title longer than the drawing is set narrower
      if (title.getComputedTextLength() > W - 8) {
        title.setAttribute("textLength", W - 8);
        title.setAttribute("lengthAdjust", "spacingAndGlyphs");
      }
    } catch (e) { /* not laid out (hidden): drawn again when shown */ }
  }

  // Horizontal stacked bars: one row per bar name, its segments the spec's parts; the names sit left of
  // the bars (set narrower when longer than the margin), or above them on a narrow screen; the parts'
  // legend under the plot.
  function drawBars(fig, spec, index, svg) {
    var frame = spec.frames[index], bars = frame.bars, parts = spec.parts;
    W = Math.round(Math.max(340, Math.min(640, fig.clientWidth || 640)));
    var narrow = W < 480, left = narrow ? 16 : Math.round(Math.min(180, W * 0.36)), rowH = narrow ? 44 : 30;
    var columns = W < 480 ? 1 : 2, legendRows = Math.ceil(parts.length / columns);
    H = M.t + rowH * bars.length + 12 + M.b;
    svg.setAttribute("viewBox", "0 0 " + W + " " + (H + 18 * legendRows));
    var sx = scale(spec.xlim, false, left, W - M.r);
    var axes = el("g", {"font-size": 13, "font-family": "sans-serif", fill: "#222"}, svg);
    var top = M.t, bottom = M.t + rowH * bars.length + 12;
    el("rect", {x: left, y: top, width: W - M.r - left, height: bottom - top, fill: "none", stroke: "#444"}, axes);
    ticks(spec.xlim, false).forEach(function (v) {
      var x = sx(v);
      el("line", {x1: x, x2: x, y1: top, y2: bottom, stroke: "#ddd"}, axes);
      var tick = el("text", {x: x, y: bottom + 16, "text-anchor": "middle"}, axes);
      tick.textContent = label(v, false);
      keepInside(tick);
    });
    el("text", {x: (left + W - M.r) / 2, y: bottom + 36, "text-anchor": "middle"}, axes).textContent = spec.xlabel;
    var title = el("text", {x: W / 2, y: 18, "text-anchor": "middle", "font-weight": "bold"}, axes);
    title.textContent = spec.title;
    fitTitle(title);
    var plot = el("g", {}, svg);
    bars.forEach(function (bar, i) {
      var row = top + 6 + rowH * i, y = narrow ? row + 16 : row, barH = narrow ? rowH - 22 : rowH - 8;
      var x = sx(0), total = 0;
      bar.values.forEach(function (v, j) {
        if (!(v > 0)) return;
        var w = Math.max(0, Math.min(sx(total + v), W - M.r) - Math.min(sx(total), W - M.r));
        el("rect", {x: Math.min(sx(total), W - M.r), y: y, width: w, height: barH, fill: parts[j].color},
           plot);
        total += v;
      });
      x = Math.min(sx(total), W - M.r - 4);
      var name = narrow ? el("text", {x: left + 2, y: row + 12}, axes)
                        : el("text", {x: left - 6, y: y + barH / 2 + 5, "text-anchor": "end"}, axes);
      name.textContent = bar.name;
      var room = narrow ? W - M.r - left - 4 : left - 10;
      try {
        if (name.getComputedTextLength() > room) {
          name.setAttribute("textLength", room);
          name.setAttribute("lengthAdjust", "spacingAndGlyphs");
        }
      } catch (e) { /* not laid out */ }
      var sum = el("text", {x: x + 4, y: y + barH / 2 + 4, "font-size": 12}, plot);
      sum.textContent = String(+total.toPrecision(3));
      try {  // the total's label goes inside the bar's end when it would cross the right edge
        if (x + 4 + sum.getComputedTextLength() > W - M.r - 2) {
          sum.setAttribute("x", x - 4);
          sum.setAttribute("text-anchor", "end");
          sum.setAttribute("fill", "#fff");
        }
      } catch (e) { /* not laid out */ }
    });
    parts.forEach(function (part, i) {
      var lx = M.l / 2 + (i % columns) * (W - M.l / 2) / 2, ly = H + 4 + 18 * Math.floor(i / columns);
      el("rect", {x: lx, y: ly - 6, width: 22, height: 12, fill: part.color}, axes);
      el("text", {x: lx + 28, y: ly + 4}, axes).textContent = part.name;
    });
    fig.querySelector(".readout").textContent = spec.slider.label + " = " + spec.slider.values[index] +
      (frame.note ? "; " + frame.note : "");
  }

  function draw(fig, spec, index) {
    var svg = fig.querySelector("svg");
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    if (spec.kind === "bars") { drawBars(fig, spec, index, svg); return; }
    var frame = spec.frames[index];
    var series = (spec.fixed || []).concat(frame.series);
    W = Math.round(Math.max(340, Math.min(640, fig.clientWidth || 640)));
    H = Math.round(Math.max(280, W * 0.5625));
    var columns = W < 480 ? 1 : 2;
    var legendRows = Math.ceil(series.length / columns);
    var height = H + 18 * legendRows;
    svg.setAttribute("viewBox", "0 0 " + W + " " + height);
    var sx = scale(spec.xlim, spec.xlog, M.l, W - M.r), sy = scale(spec.ylim, spec.ylog, H - M.b, M.t);
    var axes = el("g", {"font-size": 13, "font-family": "sans-serif", fill: "#222"}, svg);
    el("rect", {x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b, fill: "none", stroke: "#444"}, axes);
    ticks(spec.xlim, spec.xlog).forEach(function (v) {
      var x = sx(v);
      el("line", {x1: x, x2: x, y1: M.t, y2: H - M.b, stroke: "#ddd"}, axes);
      var tick = el("text", {x: x, y: H - M.b + 16, "text-anchor": "middle"}, axes);
      tick.textContent = label(v, spec.xlog);
      keepInside(tick);
    });
    ticks(spec.ylim, spec.ylog).forEach(function (v) {
      var y = sy(v);
      el("line", {x1: M.l, x2: W - M.r, y1: y, y2: y, stroke: "#ddd"}, axes);
      el("text", {x: M.l - 6, y: y + 4, "text-anchor": "end"}, axes).textContent = label(v, spec.ylog);
    });
    el("text", {x: (M.l + W - M.r) / 2, y: H - 8, "text-anchor": "middle"}, axes).textContent = spec.xlabel;
    el("text", {x: 14, y: (M.t + H - M.b) / 2, "text-anchor": "middle",
                transform: "rotate(-90 14 " + (M.t + H - M.b) / 2 + ")"}, axes).textContent = spec.ylabel;
    var title = el("text", {x: W / 2, y: 18, "text-anchor": "middle", "font-weight": "bold"}, axes);
    title.textContent = spec.title;
    fitTitle(title);
    var clip = "clip" + Math.random().toString(36).slice(2);
    var defs = el("defs", {}, svg);
    el("rect", {x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b}, el("clipPath", {id: clip}, defs));
    var plot = el("g", {"clip-path": "url(#" + clip + ")"}, svg);
    series.forEach(function (s, i) {
      var xs = s.x || spec.x, pts = [];
      s.y.forEach(function (y, j) {
        if (y !== null && isFinite(y) && (!spec.ylog || y > 0)) {
          pts.push(sx(xs[j]).toFixed(1) + "," + sy(y).toFixed(1));
        }
      });
      if (s.markers) {  // points only (a category on the x axis, e.g. attention heads): no line between them
        pts.forEach(function (p) {
          var xy = p.split(",");
          el("circle", {cx: xy[0], cy: xy[1], r: s.dash ? 3 : 4.5, fill: s.dash ? "#fff" : s.color || "#000",
                        stroke: s.color || "#000", "stroke-width": 2}, plot);
        });
      } else {
        el("polyline", {points: pts.join(" "), fill: "none", stroke: s.color || "#000", "stroke-width": 2,
                        "stroke-dasharray": s.dash ? "6 4" : "none"}, plot);
      }
      var lx = M.l + (i % columns) * (W - M.l) / 2, ly = H + 4 + 18 * Math.floor(i / columns);
      if (s.markers) {
        el("circle", {cx: lx + 14, cy: ly, r: s.dash ? 3 : 4.5, fill: s.dash ? "#fff" : s.color || "#000",
                      stroke: s.color || "#000", "stroke-width": 2}, axes);
      } else {
        el("line", {x1: lx, x2: lx + 28, y1: ly, y2: ly, stroke: s.color || "#000", "stroke-width": 2,
                    "stroke-dasharray": s.dash ? "6 4" : "none"}, axes);
      }
      el("text", {x: lx + 34, y: ly + 4}, axes).textContent = s.name;
    });
    fig.querySelector(".readout").textContent = spec.slider.label + " = " + spec.slider.values[index] +
      (frame.note ? "; " + frame.note : "");
  }

  function setup(fig) {
    var data = fig.querySelector('script[type="application/json"]');
    if (!data || fig.querySelector("svg")) return;
    var spec = JSON.parse(data.textContent);
    var controls = document.createElement("div");
    controls.className = "controls";
    var input = document.createElement("input");
    input.type = "range";
    input.min = 0;
    input.max = spec.slider.values.length - 1;
    input.step = 1;
    input.value = spec.slider.initial || 0;
    input.setAttribute("aria-label", spec.slider.label);
    var readout = document.createElement("span");
    readout.className = "readout";
    controls.appendChild(input);
    controls.appendChild(readout);
    fig.appendChild(controls);
    var svg = el("svg", {role: "img", "aria-label": spec.title}, null);
    fig.appendChild(svg);
    input.addEventListener("input", function () { draw(fig, spec, +input.value); });
    draw(fig, spec, +input.value);
    var pending = null;
    window.addEventListener("resize", function () {
      clearTimeout(pending);
      pending = setTimeout(function () { draw(fig, spec, +input.value); }, 100);
    });
  }

  function start() { document.querySelectorAll(".optbook-interactive").forEach(setup); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
