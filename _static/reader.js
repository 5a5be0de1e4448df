/* What a reader needs from the page at any width (tests/test_site.py checks each in headless Chromium).

1. Navigation buttons. sphinx-book-theme renders the sidebar toggles twice: once in the theme's top bar,
   which it hides, and once in the article header, which the reader sees. pydata-sphinx-theme binds its
   handler (open the sidebar as a dialog below 992 px) to the first `.primary-toggle` and
   `.secondary-toggle` in the document, the hidden ones (pydata-sphinx-theme#2451), so a tap on a visible
   button only showed its tooltip. Each visible button here forwards its click to the bound one, where
   sphinx-book-theme's own handler collapses the sidebar on wide screens instead.
2. Formulas wider than the column (display equations, and inline ones longer than a line) are scaled
   down to fit it (to no less than 60 %), after MathJax has typeset them and again when the window
   changes size.
3. Code lines longer than the column wrap with a hanging indent (the continuation starts four columns
   right of the line's own indentation) instead of at column 0. Each line of a cell's source becomes a
   block of its own; a block whose highlighting spans several lines (a docstring) is left as it is.
4. Multi-panel figures (an image at least 1.8 times as wide as tall) keep a readable height in a narrow
   column: below 600 px of column they are drawn PANEL_HEIGHT px tall, as wide as that makes them, in a
   box of their own that scrolls sideways (swipe to see the next panel); wider columns show them whole.
*/
(function () {
  "use strict";

  function forwardToggles() {
    ["primary-toggle", "secondary-toggle"].forEach(function (name) {
      var all = document.querySelectorAll("." + name);
      var bound = all[0];
      Array.prototype.slice.call(all, 1).forEach(function (button) {
        button.addEventListener("click", function (event) {
          event.preventDefault();
          event.stopPropagation();
          if (window.bootstrap && bootstrap.Tooltip) {
            var tip = bootstrap.Tooltip.getInstance(button);
            if (tip) tip.hide();
          }
          button.blur();
          bound.click();
        });
      });
    });
  }

  function hangingIndents() {
    document.querySelectorAll("div.cell_input div.highlight pre, div.highlight-python pre, div.highlight-ipython3 pre")
      .forEach(function (pre) {
        if (pre.dataset.lines) return;
        var lines = pre.innerHTML.split("\n");
        var balanced = lines.every(function (line) {
          return (line.match(/<span\b/g) || []).length === (line.match(/<\/span>/g) || []).length;
        });
        if (!balanced) return;
        if (lines.length && lines[lines.length - 1] === "") lines.pop();
        pre.innerHTML = lines.map(function (line) {
          var text = line.replace(/<[^>]*>/g, "");
          var indent = text.length - text.replace(/^ +/, "").length + 4;
          return '<span class="code-line" style="padding-left:' + indent + "ch;text-indent:-" + indent + 'ch">' +
            line + "\n</span>";
        }).join("");
        pre.dataset.lines = "1";
      });
  }

  var MIN_SCALE = 0.6;

  function fitEquations() {
    document.querySelectorAll("mjx-container").forEach(function (box) {
      var math = box.querySelector("mjx-math");
      if (!math) return;
      box.style.fontSize = "";
      var display = box.getAttribute("display") === "true";
      var column = display ? box : box.parentElement.closest("p, li, dd, td, div, figcaption");
      if (!column) return;
      var room = column.getBoundingClientRect().width;
      var need = math.getBoundingClientRect().width;
      if (room > 0 && need > room) {
        box.style.fontSize = Math.max(MIN_SCALE, Math.floor((room / need) * 1000) / 1000) * 100 + "%";
      }
    });
  }

  var PANEL_HEIGHT = 240, WIDE = 1.8, NARROW = 600;

  function readableFigures() {
    document.querySelectorAll(".cell_output img").forEach(function (img) {
      function fit() {
        var ratio = img.naturalWidth / img.naturalHeight;
        if (!(ratio >= WIDE)) return;
        var box = img.parentElement;
        if (!box.classList.contains("figure-scroll")) {
          box = document.createElement("div");
          box.className = "figure-scroll";
          img.parentElement.insertBefore(box, img);
          box.appendChild(img);
          img.classList.add("multi-panel");
        }
        var room = box.clientWidth;
        var want = Math.min(img.naturalWidth, Math.round(PANEL_HEIGHT * ratio));
        var narrow = room > 0 && room < NARROW && want > room;
        img.style.width = narrow ? want + "px" : "";
        img.style.maxWidth = narrow ? "none" : "";
      }
      if (img.complete && img.naturalWidth) fit();
      else img.addEventListener("load", fit);
    });
  }

  function whenTypeset(callback, tries) {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      MathJax.startup.promise.then(callback);
    } else if (tries > 0) {
      setTimeout(function () { whenTypeset(callback, tries - 1); }, 100);
    }
  }

  function start() {
    forwardToggles();
    hangingIndents();
    readableFigures();
    whenTypeset(fitEquations, 100);
    var pending = null;
    window.addEventListener("resize", function () {
      clearTimeout(pending);
      pending = setTimeout(function () { fitEquations(); readableFigures(); }, 100);
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
