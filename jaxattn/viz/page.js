// jaxattn attention viewer: reads the JSON in <script id="jaxattn-data">, draws with <canvas>, fetches nothing.
// Axis alphabet: L layers, N heads, T queries (rows), S keys (columns).
(function () {
  "use strict";

  var DATA = JSON.parse(document.getElementById("jaxattn-data").textContent);
  var LEVELS = DATA.levels;
  var MASKED = "#d9d9d9";
  var VIRIDIS = ["#440154", "#481a6c", "#472f7d", "#414487", "#39568c", "#31688e", "#2a788e", "#23888e",
                 "#1f988b", "#22a884", "#35b779", "#54c568", "#7ad151", "#a5db36", "#d2e21b", "#fde725"];
  var DIVERGING = ["#2166ac", "#67a9cf", "#d1e5f0", "#f7f7f7", "#fddbc7", "#ef8a62", "#b2182b"];

  // ---- data -------------------------------------------------------------------------------------
  function decode(b64) {  // base64 of little-endian uint16 codes -> Uint16Array
    var bin = atob(b64), n = bin.length >> 1, out = new Uint16Array(n);
    for (var i = 0; i < n; i++) out[i] = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    return out;
  }
  DATA.runs.forEach(function (r) { r.codes = decode(r.weights); delete r.weights; });
  var RUNS = DATA.runs, A = RUNS[0];

  function code(run, l, n, t, s) { return run.codes[((l * run.N + n) * run.T + t) * run.S + s]; }
  function weight(run, l, n, t, s) {  // null: masked (exactly 0)
    var c = code(run, l, n, t, s);
    return c === 0 ? null : (c - 1) / LEVELS;
  }

  // ---- state ------------------------------------------------------------------------------------
  var state = { layer: 0, head: 0, mode: "0", view: "heatmap", hover: null };
  function run() { return state.mode === "diff" ? A : RUNS[Number(state.mode)]; }
  function isDiff() { return state.mode === "diff"; }
  // The value drawn at (t, s): a weight, or in the difference view A - B; null where masked in both.
  function value(t, s) {
    var l = state.layer, n = state.head;
    if (!isDiff()) return weight(run(), l, n, t, s);
    var a = weight(RUNS[0], l, n, t, s), b = weight(RUNS[1], l, n, t, s);
    if (a === null && b === null) return null;
    return (a || 0) - (b || 0);
  }
  // Labels of the rows ("queries") or columns ("keys"); in the difference view "x/y" where A and B differ.
  function labels(which) {
    if (!isDiff()) return run()[which];
    return RUNS[0][which].map(function (x, i) { var y = RUNS[1][which][i]; return x === y ? x : x + "/" + y; });
  }
  function diffScale() {  // max |A - B| over the selected head, for the symmetric colour scale
    var m = 0, r = run();
    for (var t = 0; t < r.T; t++) for (var s = 0; s < r.S; s++) {
      var v = value(t, s);
      if (v !== null && Math.abs(v) > m) m = Math.abs(v);
    }
    return m > 0 ? m : 1e-6;
  }

  // ---- colours ----------------------------------------------------------------------------------
  function hexToRgb(h) { return [parseInt(h.slice(1, 3), 16), parseInt(h.slice(3, 5), 16), parseInt(h.slice(5, 7), 16)]; }
  function ramp(stops, x) {  // x in [0, 1]
    x = Math.min(1, Math.max(0, x));
    var p = x * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(p)), f = p - i;
    var a = hexToRgb(stops[i]), b = hexToRgb(stops[i + 1]);
    return "rgb(" + [0, 1, 2].map(function (k) { return Math.round(a[k] + f * (b[k] - a[k])); }).join(",") + ")";
  }
  function colour(v, scale) {
    if (v === null) return MASKED;
    return scale ? ramp(DIVERGING, 0.5 + 0.5 * v / scale) : ramp(VIRIDIS, v);
  }

  // ---- page -------------------------------------------------------------------------------------
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function select(id, label, options) {
    var wrap = el("label", { "for": id }, label + " ");
    var s = el("select", { id: id });
    options.forEach(function (o) { s.appendChild(el("option", { value: o[0] }, o[1])); });
    wrap.appendChild(s);
    return [wrap, s];
  }
  function range(n, prefix) { var o = []; for (var i = 0; i < n; i++) o.push([String(i), prefix + i]); return o; }
  function q(s) { return JSON.stringify(s); }
  function fmt(x) { return x.toFixed(4); }
  function signed(x) { return (x >= 0 ? "+" : "\u2212") + Math.abs(x).toFixed(4); }

  document.title = DATA.title;
  var body = document.body;
  body.appendChild(el("h1", { id: "title" }, DATA.title));
  RUNS.forEach(function (r) {
    body.appendChild(el("p", { "class": "summary" }, r.name + ": " + r.L + " layers \u00d7 " + r.N + " heads, " + r.T +
      " queries \u00d7 " + r.S + " keys" + (r.causal ? " (causal: a query sees no later key; hidden keys are grey)" : "")));
  });
  var controls = el("div", { id: "controls" });
  var layerSel = select("layer", "layer", range(A.L, "")), headSel = select("head", "head", range(A.N, ""));
  var modes = RUNS.map(function (r, i) { return [String(i), r.name]; });
  if (DATA.difference) modes.push(["diff", "difference: " + RUNS[0].name + " \u2212 " + RUNS[1].name]);
  var modeSel = select("mode", "show", modes);
  var viewSel = select("view", "view", [["heatmap", "heatmap"], ["lines", "lines"], ["both", "both"]]);
  [layerSel, headSel, modeSel, viewSel].forEach(function (p) { controls.appendChild(p[0]); });
  if (RUNS.length < 2) modeSel[0].hidden = true;
  body.appendChild(controls);
  if (DATA.difference_note) body.appendChild(el("p", { "class": "note" }, DATA.difference_note));

  var main = el("div", { id: "main" });
  var overviewBox = el("section", { id: "overview-box" });
  var overviewTitle = el("h2", {}, "");
  var overview = el("canvas", { id: "overview" });
  var overviewLegend = el("canvas", { id: "overview-legend" });
  overviewBox.appendChild(overviewTitle);
  overviewBox.appendChild(overview);
  overviewBox.appendChild(overviewLegend);
  var mapsBox = el("section", { id: "maps-box" });
  var mapsTitle = el("h2", {}, "");
  var heatmap = el("canvas", { id: "heatmap" });
  var lines = el("canvas", { id: "lines" });
  var legend = el("canvas", { id: "legend" });
  mapsBox.appendChild(mapsTitle);
  var pictures = el("div", { id: "pictures" });
  pictures.appendChild(heatmap);
  pictures.appendChild(lines);
  mapsBox.appendChild(pictures);
  mapsBox.appendChild(legend);
  main.appendChild(overviewBox);
  main.appendChild(mapsBox);
  body.appendChild(main);
  var tooltip = el("div", { id: "tooltip", role: "status" });
  tooltip.hidden = true;
  body.appendChild(tooltip);

  // ---- drawing helpers --------------------------------------------------------------------------
  var FONT = "12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
  function setup(canvas, w, h) {  // size in CSS pixels; the backing store follows devicePixelRatio
    var r = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, Math.round(w * r));
    canvas.height = Math.max(1, Math.round(h * r));
    canvas.style.width = w + "px";
    canvas.style.height = h + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(r, 0, 0, r, 0, 0);
    ctx.font = FONT;
    return ctx;
  }
  var measure = document.createElement("canvas").getContext("2d");
  measure.font = FONT;
  function textWidth(s) { return measure.measureText(s).width; }
  function shown(s) { return s.replace(/\s/g, "\u00b7"); }  // spaces made visible: " it" -> "·it"

  // ---- heatmap ----------------------------------------------------------------------------------
  function drawHeatmap() {
    var r = run(), T = r.T, S = r.S;
    var cell = Math.max(10, Math.min(32, Math.floor(520 / Math.max(T, S))));
    var qlab = labels("queries").map(function (x, i) { return i + " " + shown(x); });
    var klab = labels("keys").map(function (x, i) { return i + " " + shown(x); });
    var x0 = Math.ceil(Math.max.apply(null, qlab.map(textWidth))) + 10;
    var y0 = Math.ceil(Math.max.apply(null, klab.map(textWidth))) + 10;
    var ctx = setup(heatmap, x0 + S * cell + 2, y0 + T * cell + 2);
    heatmap.dataset.x0 = x0; heatmap.dataset.y0 = y0; heatmap.dataset.cell = cell;
    heatmap.dataset.rows = T; heatmap.dataset.cols = S;
    var scale = isDiff() ? diffScale() : 0;
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, x0 + S * cell + 2, y0 + T * cell + 2);
    for (var t = 0; t < T; t++) for (var s = 0; s < S; s++) {
      var v = value(t, s);
      ctx.fillStyle = colour(v, scale);
      ctx.fillRect(x0 + s * cell, y0 + t * cell, cell, cell);
      if (v === null && cell >= 12) {  // a small dot: hidden by the mask
        ctx.fillStyle = "#9a9a9a";
        ctx.fillRect(x0 + (s + 0.5) * cell - 1, y0 + (t + 0.5) * cell - 1, 2, 2);
      }
    }
    var h = state.hover;
    ctx.fillStyle = "#222";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (t = 0; t < T; t++) {
      ctx.font = h && h.t === t ? "bold " + FONT : FONT;
      ctx.fillText(qlab[t], x0 - 5, y0 + (t + 0.5) * cell);
    }
    for (s = 0; s < S; s++) {
      ctx.save();
      ctx.translate(x0 + (s + 0.5) * cell, y0 - 5);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.font = h && h.s === s ? "bold " + FONT : FONT;
      ctx.fillText(klab[s], 0, 0);
      ctx.restore();
    }
    if (h && h.t !== undefined && h.s !== undefined && h.t < T && h.s < S) {
      ctx.strokeStyle = "#e8003d";
      ctx.lineWidth = 2;
      ctx.strokeRect(x0 + h.s * cell + 1, y0 + h.t * cell + 1, cell - 2, cell - 2);
    }
    drawLegend(legend, scale, isDiff() ? "difference (" + RUNS[0].name + " \u2212 " + RUNS[1].name + ")" : "weight");
  }

  function cellAt(canvas, ev) {
    var b = canvas.getBoundingClientRect();
    var x = ev.clientX - b.left - Number(canvas.dataset.x0), y = ev.clientY - b.top - Number(canvas.dataset.y0);
    var c = Number(canvas.dataset.cell);
    var s = Math.floor(x / c), t = Math.floor(y / c);
    if (x < 0 || y < 0 || t >= Number(canvas.dataset.rows) || s >= Number(canvas.dataset.cols)) return null;
    return { t: t, s: s };
  }

  // ---- BertViz-style lines ----------------------------------------------------------------------
  var ROW = 18, GAP = 170;
  function linesGeometry() {
    var ql = labels("queries").map(shown), kl = labels("keys").map(shown);
    var xl = Math.ceil(Math.max.apply(null, ql.map(textWidth))) + 14;
    return { xl: xl, xr: xl + GAP, w: xl + GAP + Math.ceil(Math.max.apply(null, kl.map(textWidth))) + 14, ql: ql, kl: kl, y0: 22 };
  }
  function drawLines() {
    var r = run(), g = linesGeometry(), T = r.T, S = r.S;
    var ctx = setup(lines, g.w, g.y0 + Math.max(T, S) * ROW + 6);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, g.w, g.y0 + Math.max(T, S) * ROW + 6);
    ctx.fillStyle = "#555";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    ctx.fillText("queries", g.xl - 6, 9);
    ctx.textAlign = "left";
    ctx.fillText("keys", g.xr + 6, 9);
    var h = state.hover, scale = isDiff() ? diffScale() : 0;
    ctx.lineWidth = 2;
    for (var t = 0; t < T; t++) for (var s = 0; s < S; s++) {
      var v = value(t, s);
      if (v === null || v === 0) continue;
      var focus = !h || (h.t === undefined || h.t === t) && (h.s === undefined || h.s === s);
      var alpha = Math.min(1, scale ? Math.abs(v) / scale : v) * (focus ? 1 : 0.08);
      if (alpha < 0.01) continue;
      ctx.strokeStyle = scale ? (v > 0 ? "rgba(178,24,43," : "rgba(33,102,172,") + alpha + ")" : "rgba(31,119,180," + alpha + ")";
      ctx.beginPath();
      ctx.moveTo(g.xl, g.y0 + (t + 0.5) * ROW);
      ctx.lineTo(g.xr, g.y0 + (s + 0.5) * ROW);
      ctx.stroke();
    }
    ctx.fillStyle = "#222";
    for (t = 0; t < T; t++) {
      ctx.textAlign = "right";
      ctx.font = h && h.t === t ? "bold " + FONT : FONT;
      ctx.fillText(g.ql[t], g.xl - 6, g.y0 + (t + 0.5) * ROW);
    }
    for (s = 0; s < S; s++) {
      ctx.textAlign = "left";
      ctx.font = h && h.s === s ? "bold " + FONT : FONT;
      ctx.fillText(g.kl[s], g.xr + 6, g.y0 + (s + 0.5) * ROW);
    }
    lines.dataset.xl = g.xl; lines.dataset.xr = g.xr; lines.dataset.y0 = g.y0; lines.dataset.row = ROW;
  }
  function tokenAt(ev) {  // hovering a query (left) or key (right) token in the lines view
    var r = run(), b = lines.getBoundingClientRect(), g = linesGeometry();
    var x = ev.clientX - b.left, i = Math.floor((ev.clientY - b.top - g.y0) / ROW);
    if (i < 0) return null;
    if (x < g.xl + 20 && i < r.T) return { t: i };
    if (x > g.xr - 20 && i < r.S) return { s: i };
    return null;
  }

  // ---- entropy overview -------------------------------------------------------------------------
  function entropyValue(l, n) {
    if (!isDiff()) { var r = run(); return l < r.L && n < r.N ? r.entropy[l][n] : null; }
    return RUNS[0].entropy[l][n] - RUNS[1].entropy[l][n];
  }
  function overviewGeometry() {
    var r = run(), cell = Math.max(10, Math.min(22, Math.floor(300 / Math.max(r.N, 1))));
    return { x0: 34, y0: 18, cell: cell, L: r.L, N: r.N };
  }
  function drawOverview() {
    var g = overviewGeometry(), ctx = setup(overview, g.x0 + g.N * g.cell + 2, g.y0 + g.L * g.cell + 2);
    // Colours span the heads' range: [min, max] of the entropies, or [-m, m] for their differences.
    var vmin = Infinity, vmax = -Infinity, l, n, v;
    for (l = 0; l < g.L; l++) for (n = 0; n < g.N; n++) {
      v = entropyValue(l, n);
      if (v === null) continue;
      vmin = Math.min(vmin, isDiff() ? -Math.abs(v) : v);
      vmax = Math.max(vmax, Math.abs(v));
    }
    if (isDiff()) { vmax = Math.max(vmax, 1e-6); vmin = -vmax; }
    if (!(vmax > vmin)) { vmin = Math.min(vmin, 0); vmax = vmin + 1e-6; }
    overviewTitle.textContent = isDiff() ? "mean row entropy per head, " + RUNS[0].name + " \u2212 " + RUNS[1].name + " (nats)"
                                         : "mean row entropy per head (nats), " + run().name + "; click a head";
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, g.x0 + g.N * g.cell + 2, g.y0 + g.L * g.cell + 2);
    for (l = 0; l < g.L; l++) for (n = 0; n < g.N; n++) {
      v = entropyValue(l, n);
      ctx.fillStyle = v === null ? MASKED : ramp(isDiff() ? DIVERGING : VIRIDIS, (v - vmin) / (vmax - vmin));
      ctx.fillRect(g.x0 + n * g.cell, g.y0 + l * g.cell, g.cell - 1, g.cell - 1);
    }
    ctx.fillStyle = "#222";
    ctx.font = "10px sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    var every = g.cell >= 12 ? 1 : 5;
    for (l = 0; l < g.L; l += every) ctx.fillText("L" + l, g.x0 - 4, g.y0 + (l + 0.5) * g.cell);
    ctx.textAlign = "center";
    for (n = 0; n < g.N; n += (g.cell >= 18 ? 1 : 2)) ctx.fillText("h" + n, g.x0 + (n + 0.5) * g.cell, 9);
    ctx.strokeStyle = "#e8003d";
    ctx.lineWidth = 2;
    ctx.strokeRect(g.x0 + state.head * g.cell, g.y0 + state.layer * g.cell, g.cell - 1, g.cell - 1);
    overview.dataset.x0 = g.x0; overview.dataset.y0 = g.y0; overview.dataset.cell = g.cell;
    overview.dataset.rows = g.L; overview.dataset.cols = g.N;
    drawLegend(overviewLegend, isDiff() ? vmax : 0, isDiff() ? "entropy difference (nats)" : "entropy (nats)", vmax, vmin);
  }

  function drawLegend(canvas, scale, label, top, bottom) {
    var w = 220, ctx = setup(canvas, w + 40, 46);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, w + 40, 46);
    for (var i = 0; i < w; i++) {
      ctx.fillStyle = scale ? ramp(DIVERGING, i / (w - 1)) : ramp(VIRIDIS, i / (w - 1));
      ctx.fillRect(20 + i, 4, 1, 12);
    }
    ctx.fillStyle = "#222";
    ctx.font = "10px sans-serif";
    ctx.textBaseline = "top";
    ctx.textAlign = "center";
    var hi = scale || top || 1, lo = scale ? -scale : bottom || 0;
    [[0, lo], [0.5, (lo + hi) / 2], [1, hi]].forEach(function (p) {
      ctx.fillText(Number(p[1].toPrecision(3)).toString(), 20 + p[0] * (w - 1), 19);
    });
    ctx.textAlign = "left";
    ctx.fillText(label, 20, 32);
    canvas.setAttribute("aria-label", label + " colour scale from " + lo + " to " + hi);
  }

  // ---- tooltip ----------------------------------------------------------------------------------
  function showTip(ev, text, attrs) {
    tooltip.textContent = text;
    Array.prototype.slice.call(tooltip.attributes).forEach(function (a) {
      if (a.name.indexOf("data-") === 0) tooltip.removeAttribute(a.name);
    });
    Object.keys(attrs).forEach(function (k) { tooltip.setAttribute("data-" + k, String(attrs[k])); });
    tooltip.hidden = false;
    tooltip.style.left = Math.min(ev.clientX + 14, window.innerWidth - 320) + "px";
    tooltip.style.top = ev.clientY + 14 + "px";
  }
  function hideTip() { tooltip.hidden = true; }

  function pairText(t, s) {
    var r = run(), l = state.layer, n = state.head, ql = labels("queries"), kl = labels("keys");
    var head = "layer " + l + ", head " + n + ": query " + t + " " + q(ql[t]) + " \u2192 key " + s + " " + q(kl[s]);
    var attrs = { layer: l, head: n, query: t, key: s, "query-token": ql[t], "key-token": kl[s] };
    if (!isDiff()) {
      var w = weight(r, l, n, t, s);
      attrs.weight = w === null ? 0 : w;
      attrs.masked = w === null;
      return [head + "\n" + (w === null ? "weight 0 (hidden by the mask)" : "weight " + fmt(w)), attrs];
    }
    var a = weight(RUNS[0], l, n, t, s), b = weight(RUNS[1], l, n, t, s);
    attrs.weight = (a || 0) - (b || 0);
    attrs.masked = a === null && b === null;
    return [head + "\n" + RUNS[0].name + " " + fmt(a || 0) + " \u2212 " + RUNS[1].name + " " + fmt(b || 0) + " = " +
            signed((a || 0) - (b || 0)), attrs];
  }

  // ---- events -----------------------------------------------------------------------------------
  function redraw() {
    var r = run();
    mapsTitle.textContent = (isDiff() ? "difference " + RUNS[0].name + " \u2212 " + RUNS[1].name : r.name) +
      ": layer " + state.layer + ", head " + state.head + " (rows: queries, columns: keys)";
    heatmap.hidden = state.view === "lines";
    lines.hidden = state.view === "heatmap";
    drawOverview();
    if (!heatmap.hidden) drawHeatmap(); else drawLegend(legend, isDiff() ? diffScale() : 0, isDiff() ? "difference" : "weight");
    if (!lines.hidden) drawLines();
    document.body.dataset.layer = state.layer;
    document.body.dataset.head = state.head;
    document.body.dataset.mode = state.mode;
    document.body.dataset.view = state.view;
  }
  function fill(sel, n, keep) {
    var old = Number(keep);
    sel.innerHTML = "";
    range(n, "").forEach(function (o) { sel.appendChild(el("option", { value: o[0] }, o[1])); });
    sel.value = String(Math.min(old, n - 1));
    return Number(sel.value);
  }
  layerSel[1].addEventListener("change", function () { state.layer = Number(layerSel[1].value); state.hover = null; redraw(); });
  headSel[1].addEventListener("change", function () { state.head = Number(headSel[1].value); state.hover = null; redraw(); });
  viewSel[1].addEventListener("change", function () { state.view = viewSel[1].value; state.hover = null; redraw(); });
  modeSel[1].addEventListener("change", function () {
    state.mode = modeSel[1].value;
    var r = run();
    state.layer = fill(layerSel[1], r.L, state.layer);
    state.head = fill(headSel[1], r.N, state.head);
    state.hover = null;
    hideTip();
    redraw();
  });
  heatmap.addEventListener("mousemove", function (ev) {
    var c = cellAt(heatmap, ev);
    if (!c) { if (state.hover) { state.hover = null; hideTip(); drawHeatmap(); } return; }
    var p = pairText(c.t, c.s);
    showTip(ev, p[0], p[1]);
    if (!state.hover || state.hover.t !== c.t || state.hover.s !== c.s) { state.hover = c; drawHeatmap(); }
  });
  heatmap.addEventListener("mouseleave", function () { state.hover = null; hideTip(); drawHeatmap(); });
  lines.addEventListener("mousemove", function (ev) {
    var k = tokenAt(ev), r = run();
    if (!k) { if (state.hover) { state.hover = null; hideTip(); drawLines(); } return; }
    var vals = [], i, n = k.t !== undefined ? r.S : r.T;
    for (i = 0; i < n; i++) {
      var v = k.t !== undefined ? value(k.t, i) : value(i, k.s);
      if (v !== null) vals.push([i, v]);
    }
    vals.sort(function (a, b) { return Math.abs(b[1]) - Math.abs(a[1]); });
    var ql = labels("queries"), kl = labels("keys"), names = k.t !== undefined ? kl : ql;
    var top = vals.slice(0, 3).map(function (p) { return q(names[p[0]]) + " " + (isDiff() ? signed(p[1]) : fmt(p[1])); });
    var what = k.t !== undefined ? "query " + k.t + " " + q(ql[k.t]) + " looks most at: "
                                 : "key " + k.s + " " + q(kl[k.s]) + " is looked at most by: ";
    showTip(ev, "layer " + state.layer + ", head " + state.head + ": " + what + top.join(", "),
            k.t !== undefined ? { query: k.t } : { key: k.s });
    state.hover = k;
    drawLines();
  });
  lines.addEventListener("mouseleave", function () { state.hover = null; hideTip(); drawLines(); });
  function overviewCell(ev) { return cellAt(overview, ev); }
  overview.addEventListener("mousemove", function (ev) {
    var c = overviewCell(ev);
    if (!c) { hideTip(); return; }
    var text = "layer " + c.t + ", head " + c.s + ": mean row entropy ";
    if (isDiff()) {
      var a = RUNS[0].entropy[c.t][c.s], b = RUNS[1].entropy[c.t][c.s];
      text += RUNS[0].name + " " + fmt(a) + " \u2212 " + RUNS[1].name + " " + fmt(b) + " = " + signed(a - b) + " nats";
    } else {
      text += fmt(run().entropy[c.t][c.s]) + " nats";
    }
    showTip(ev, text + " (click to show)", { layer: c.t, head: c.s });
  });
  overview.addEventListener("mouseleave", hideTip);
  overview.addEventListener("click", function (ev) {
    var c = overviewCell(ev);
    if (!c) return;
    state.layer = c.t; state.head = c.s; state.hover = null;
    layerSel[1].value = String(c.t);
    headSel[1].value = String(c.s);
    redraw();
  });
  document.addEventListener("keydown", function (ev) {  // arrow keys step through heads and layers
    if (ev.target && ev.target.tagName === "SELECT") return;
    var r = run(), moved = true;
    if (ev.key === "ArrowRight") state.head = (state.head + 1) % r.N;
    else if (ev.key === "ArrowLeft") state.head = (state.head + r.N - 1) % r.N;
    else if (ev.key === "ArrowDown") state.layer = (state.layer + 1) % r.L;
    else if (ev.key === "ArrowUp") state.layer = (state.layer + r.L - 1) % r.L;
    else moved = false;
    if (moved) { ev.preventDefault(); layerSel[1].value = String(state.layer); headSel[1].value = String(state.head); redraw(); }
  });
  redraw();
  document.body.dataset.ready = "true";
})();
