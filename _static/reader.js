/* What a reader needs from the page at any width (tests/test_site.py checks each in headless Chromium).

1. Navigation buttons. sphinx-book-theme renders the sidebar toggles twice: once in the theme's top bar,
   which it hides, and once in the article header, which the reader sees. pydata-sphinx-theme binds its
   handler (open the sidebar as a dialog below 992 px) to the first `.primary-toggle` and
   `.secondary-toggle` in the document, the hidden ones (pydata-sphinx-theme#2451), so a tap on a visible
   button only showed its tooltip. Each visible button here forwards its click to the bound one, where
   sphinx-book-theme's own handler collapses the sidebar on wide screens instead.
2. Formulas wider than the column (display equations, and inline ones longer than a line) are scaled
   down from the size MathJax chose (its font-size on the formula's box, e.g. 127.3 %, which matches the
   text's x-height) to fit it, to no less than 80 % of that size; a formula that still does not fit
   scrolls sideways in its own box (custom.css). Formulas that fit keep MathJax's size. Done after
   MathJax has typeset them and again when the window changes size.
3. The page-contents drawer (a dialog on narrow screens) closes once a section in it is picked: the
   link only scrolls this page, and the open drawer hid the section the reader asked for.
4. Tables that a script did not wrap (pydata-sphinx-theme wraps those of the text) scroll sideways in a
   box of their own, so that their words never break.
Code scrolls sideways inside its box (custom.css): a line is never wrapped.
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

  var MIN_SCALE = 0.8;

  // Each formula's own size from MathJax, kept in data-mjx-size, is the 100 % that fitting scales.
  function fitEquations() {
    document.querySelectorAll("mjx-container").forEach(function (box) {
      var math = box.querySelector("mjx-math");
      if (!math) return;
      if (box.dataset.mjxSize === undefined) box.dataset.mjxSize = box.style.fontSize || "";
      var base = box.dataset.mjxSize;
      box.style.fontSize = base;
      delete box.dataset.fitted;
      var display = box.getAttribute("display") === "true";
      var column = display ? box : box.parentElement.closest("p, li, dd, td, div, figcaption");
      if (!column) return;
      var room = column.getBoundingClientRect().width;
      var need = math.getBoundingClientRect().width;
      if (room > 0 && need > room) {
        var factor = Math.max(MIN_SCALE, Math.floor((room / need) * 1000) / 1000);
        box.style.fontSize = (parseFloat(base) || 100) * factor + "%";
        box.dataset.fitted = String(factor);
        // still too wide at the floor: an inline formula scrolls in its own box (custom.css)
        box.classList.toggle("math-scroll", !display && math.getBoundingClientRect().width > room + 1);
      } else {
        box.classList.remove("math-scroll");
      }
    });
  }

  function closeDrawerOnPick() {
    var dialog = document.getElementById("pst-secondary-sidebar-modal");
    if (!dialog) return;
    dialog.addEventListener("click", function (event) {
      var link = event.target.closest && event.target.closest("a[href]");
      if (link && dialog.open && (link.getAttribute("href") || "").charAt(0) === "#") dialog.close();
    });
  }

  function scrollingTables() {
    document.querySelectorAll(".bd-article table").forEach(function (table) {
      for (var a = table.parentElement; a && !a.classList.contains("bd-article"); a = a.parentElement) {
        var x = getComputedStyle(a).overflowX;
        if (x === "auto" || x === "scroll") return;
      }
      var box = document.createElement("div");
      box.className = "table-scroll";
      table.parentElement.insertBefore(box, table);
      box.appendChild(table);
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
    closeDrawerOnPick();
    scrollingTables();
    whenTypeset(fitEquations, 100);
    var pending = null;
    window.addEventListener("resize", function () {
      clearTimeout(pending);
      pending = setTimeout(fitEquations, 100);
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
