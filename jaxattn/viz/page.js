// jaxattn attention viewer: reads the JSON in <script id="jaxattn-data">, draws with <canvas>, fetches nothing.
// Axis alphabet: L layers, N heads, T queries (rows), S keys (columns).
// Layout: every picture is sized from the viewport (again on resize): the entropy grid, the table panel
// and the maps share one row below the controls, each with its colour bar, and fit the window whenever
// their cells can keep at least their minimum sizes (MIN_*); beyond that the page wraps and scrolls.
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
  var TABLES = DATA.tables || [];  // [{name, values [L][N], null = no value}], of A's heads
  var TOP = DATA.top === undefined ? 10 : DATA.top;  // how many heads the list beside a table shows

  function code(run, l, n, t, s) { return run.codes[((l * run.N + n) * run.T + t) * run.S + s]; }
  function weight(run, l, n, t, s) {  // null: masked (exactly 0)
    var c = code(run, l, n, t, s);
    return c === 0 ? null : (c - 1) / LEVELS;
  }

  // ---- state ------------------------------------------------------------------------------------
  var state = { layer: 0, head: 0, mode: "0", view: "heatmap", table: 0, hover: null };
  function run() { return state.mode === "diff" ? A : RUNS[Number(state.mode)]; }
  function isDiff() { return state.mode === "diff"; }
  function headsOfA() { var r = run(); return r.L === A.L && r.N === A.N; }  // the tables' heads are A's
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
  // A table's colour scale: blue-white-red from -m to m (m = max |value|) when it has both signs,
  // otherwise viridis from its smallest value to its largest; "none" when every head has no value.
  function tableScale(table) {
    if (table.scale) return table.scale;
    var lo = Infinity, hi = -Infinity;
    table.values.forEach(function (row) {
      row.forEach(function (v) { if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
    });
    var m = Math.max(-lo, hi);
    table.scale = lo === Infinity ? { kind: "none", palette: [MASKED, MASKED], lo: NaN, hi: NaN }
                : lo < 0 && hi > 0 ? { kind: "diverging", palette: DIVERGING, lo: -m, hi: m }
                : { kind: "sequential", palette: VIRIDIS, lo: lo, hi: hi };
    return table.scale;
  }

  // ---- colours ----------------------------------------------------------------------------------
  function hexToRgb(h) { return [parseInt(h.slice(1, 3), 16), parseInt(h.slice(3, 5), 16), parseInt(h.slice(5, 7), 16)]; }
  function ramp(stops, x) {  // x in [0, 1]; below 0 (or NaN) is 0, above 1 is 1
    x = x > 0 ? Math.min(1, x) : 0;
    var p = x * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(p)), f = p - i;
    var a = hexToRgb(stops[i]), b = hexToRgb(stops[i + 1]);
    return "rgb(" + [0, 1, 2].map(function (k) { return Math.round(a[k] + f * (b[k] - a[k])); }).join(",") + ")";
  }
  function colour(v, scale) {
    if (v === null) return MASKED;
    return scale ? ramp(DIVERGING, 0.5 + 0.5 * v / scale) : ramp(VIRIDIS, v);
  }
  // v's place on the scale from lo to hi, in [0, 1]; a flat scale: its middle colour. Where hi - lo overflows
  // to Infinity (values near the largest double, +-1.8e308), from the halves, which cannot.
  function scaled(v, lo, hi) {
    if (!(hi > lo)) return 0.5;
    return isFinite(hi - lo) ? (v - lo) / (hi - lo) : (v / 2 - lo / 2) / (hi / 2 - lo / 2);
  }
  function mid(lo, hi) { return isFinite(lo + hi) ? (lo + hi) / 2 : lo / 2 + hi / 2; }

  // ---- page -------------------------------------------------------------------------------------
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function gridWrap(canvas, labels) {  // a grid's canvas with its layer and head labels (elements) over it
    var wrap = el("div", { "class": "grid-wrap" });
    wrap.appendChild(canvas);
    wrap.appendChild(labels);
    return wrap;
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
  // x to `digits` significant digits; x in full where rounding up would pass the largest double (1.8e308)
  function digits(x, n) { var r = Number(x.toPrecision(n)); return String(isFinite(r) ? r : x); }
  function num(x) { return digits(x, 4); }  // a table's value, 4 significant digits

  document.title = DATA.title;
  var body = document.body;
  body.appendChild(el("h1", { id: "title", title: DATA.title }, DATA.title));
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

  // Each box: a one-line head (fixed height, page.css .head), its picture, its colour bar.
  var main = el("div", { id: "main" });
  var overviewBox = el("section", { id: "overview-box", "class": "box" });
  var overviewTitle = el("h2", { "class": "head" }, "");
  var overview = el("canvas", { id: "overview" });
  var overviewLabels = el("div", { id: "overview-labels", "class": "grid-labels" });
  var overviewLegend = el("canvas", { id: "overview-legend", "class": "legend" });
  [overviewTitle, gridWrap(overview, overviewLabels), overviewLegend].forEach(function (e) { overviewBox.appendChild(e); });
  main.appendChild(overviewBox);
  var tableBox = el("section", { id: "table-box", "class": "box" });
  var tableHead = el("div", { "class": "head" });
  var tableSel = select("table", "table", TABLES.map(function (t, i) { return [String(i), t.name]; }));
  tableHead.appendChild(tableSel[0]);
  var tableGrid = el("canvas", { id: "table-grid" });
  var tableLabels = el("div", { id: "table-labels", "class": "grid-labels" });
  var tableLegend = el("canvas", { id: "table-legend", "class": "legend" });
  // Beside the grid: the table's whole name (it wraps) and its TOP heads of largest |value| (click to show).
  var tableRow = el("div", { id: "table-row" }), tableCol = el("div", { "class": "grid-col" });
  var tableSide = el("div", { id: "table-side" });
  var tableName = el("div", { id: "table-name" });
  var tableTop = el("ol", { id: "table-top" });
  [gridWrap(tableGrid, tableLabels), tableLegend].forEach(function (e) { tableCol.appendChild(e); });
  [tableName, tableTop].forEach(function (e) { tableSide.appendChild(e); });
  tableRow.appendChild(tableCol);
  tableRow.appendChild(tableSide);
  [tableHead, tableRow].forEach(function (e) { tableBox.appendChild(e); });
  tableBox.hidden = TABLES.length === 0;
  main.appendChild(tableBox);
  var mapsBox = el("section", { id: "maps-box", "class": "box" });
  var mapsTitle = el("h2", { "class": "head" }, "");
  var heatmap = el("canvas", { id: "heatmap" });
  var lines = el("canvas", { id: "lines" });
  var legend = el("canvas", { id: "legend", "class": "legend" });
  mapsBox.appendChild(mapsTitle);
  var pictures = el("div", { id: "pictures" });
  pictures.appendChild(heatmap);
  pictures.appendChild(lines);
  mapsBox.appendChild(pictures);
  mapsBox.appendChild(legend);
  main.appendChild(mapsBox);
  body.appendChild(main);
  var tooltip = el("div", { id: "tooltip", role: "status" });
  tooltip.hidden = true;
  body.appendChild(tooltip);

  // ---- drawing helpers --------------------------------------------------------------------------
  function mono(size) { return clamp(size, 8, 12) + "px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace"; }
  var FONT = mono(12);
  var SMALL = "10px sans-serif";
  function setup(canvas, w, h) {  // size in CSS pixels; the backing store follows devicePixelRatio
    var r = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, Math.round(w * r));
    canvas.height = Math.max(1, Math.round(h * r));
    canvas.style.width = w + "px";
    canvas.style.height = h + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(r, 0, 0, r, 0, 0);
    ctx.font = FONT;
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, w, h);
    return ctx;
  }
  var measure = document.createElement("canvas").getContext("2d");
  function textWidth(s, font) { measure.font = font || FONT; return measure.measureText(s).width; }
  function widest(list, font) { return Math.ceil(Math.max.apply(null, list.map(function (s) { return textWidth(s, font); }))); }
  // Spaces made visible (" it" -> "·it"); an axis label longer than LABEL_CHARS code points ends in "…"
  // (the tooltip has the whole token).
  var LABEL_CHARS = 20;
  function shown(s) {
    var c = Array.from(s.replace(/\s/g, "\u00b7"));
    return c.length > LABEL_CHARS ? c.slice(0, LABEL_CHARS - 1).join("") + "\u2026" : c.join("");
  }
  function fitText(s, width, font) {  // s, cut to "…" where it would be wider than width
    if (textWidth(s, font) <= width) return s;
    var c = Array.from(s);
    while (c.length > 1 && textWidth(c.join("") + "\u2026", font) > width) c.pop();
    return c.join("") + "\u2026";
  }

  // ---- layout -----------------------------------------------------------------------------------
  var MIN_GRID_CELL = 4, MAX_GRID_CELL = 22, GRID_X0 = 34, GRID_Y0 = 18;  // [L, N] grids: "L29" left, "h8" above
  var MAX_LABEL_FONT = 10, MIN_LABEL_FONT = 6, SIDE_GAP = 10;  // grid labels; the gap before a table's list
  var MIN_CELL = 6, MAX_CELL = 32;  // heatmap cells
  var MIN_ROW = 9, MAX_ROW = 18, MIN_GAP = 80, MAX_GAP = 170;  // lines: a token's row, the space the lines cross
  var LEGEND_H = 42, MIN_LEGEND = 150, MAX_LEGEND = 260;
  var geo = null;  // the sizes of the last layout, read by the drawing and hover code
  function px(e, prop) { return parseFloat(getComputedStyle(e)[prop]) || 0; }
  function clamp(x, lo, hi) { return Math.max(lo, Math.min(hi, x)); }
  function layout() {
    var root = document.documentElement;
    var width = root.clientWidth - px(body, "marginLeft") - px(body, "marginRight") - 1;
    var height = root.clientHeight - (main.getBoundingClientRect().top + window.scrollY) - px(body, "marginBottom") - 1;
    var gap = px(main, "columnGap"), pgap = px(pictures, "columnGap");
    var head = overviewTitle.getBoundingClientRect().height + px(overviewTitle, "marginBottom");
    var r = run(), T = r.T, S = r.S, g = { root: root.clientWidth };

    function grid(L, N) {  // an [L, N] grid whose box (head, grid, colour bar) is at most `height` tall
      var y0 = GRID_Y0, cell = 0, lab = null;
      for (var i = 0; i < 2; i++) {  // the head labels' height depends on the cell, the cell on their height
        cell = Math.floor((height - head - y0 - 2 - LEGEND_H) / L);
        cell = clamp(Math.min(cell, Math.max(Math.floor(300 / N), MIN_LABEL_FONT + 3)), MIN_GRID_CELL, MAX_GRID_CELL);
        lab = gridLabels(L, N, cell);
        y0 = lab.y0;
      }
      var x0 = Math.max(GRID_X0, lab.x0);
      var w = x0 + N * cell + 10, legendW = clamp(w, MIN_LEGEND, MAX_LEGEND);
      return { cell: cell, L: L, N: N, w: w, x0: x0, y0: y0, lab: lab, legendW: legendW, box: Math.max(w, legendW) };
    }
    g.overview = grid(r.L, r.N);
    var room = width - g.overview.box - gap;
    if (TABLES.length) {
      g.table = grid(A.L, A.N);
      g.side = TOP > 0 ? sideWidth() : 0;
      room -= g.table.box + (g.side ? SIDE_GAP + g.side : 0) + gap;
    }

    var tall = height - head - LEGEND_H, both = state.view === "both", pw = 0;
    if (state.view !== "heatmap") {
      var row = clamp(Math.floor((tall - 28) / Math.max(T, S)), MIN_ROW, MAX_ROW), font = mono(row - 1);
      var ql = labels("queries").map(shown), kl = labels("keys").map(shown);
      var xl = Math.max(widest(ql, font), textWidth("queries")) + 14, xk = Math.max(widest(kl, font), textWidth("keys")) + 14;
      g.lines = { ql: ql, kl: kl, xl: xl, xk: xk, gap: MAX_GAP, row: row, y0: 22, font: font };
    }
    if (state.view !== "lines") {
      var qlab = labels("queries").map(function (x, i) { return i + " " + shown(x); });
      var klab = labels("keys").map(function (x, i) { return i + " " + shown(x); });
      var heat = function (font) {  // the cell that fits, with labels in this font
        var x0 = widest(qlab, font) + 10, y0 = widest(klab, font) + 10;
        var byHeight = Math.floor((tall - y0 - 2) / T);
        var linesW = both ? g.lines.xl + g.lines.gap + g.lines.xk + pgap : 0;
        var byWidth = Math.floor((room - linesW - x0 - 2) / S);
        var give = 0;
        if (both && byWidth < Math.min(byHeight, MAX_CELL)) {  // narrow the lines before the cells
          give = Math.min(MAX_GAP - MIN_GAP, (Math.min(byHeight, MAX_CELL) - byWidth) * S);
          byWidth = Math.floor((room - linesW + give - x0 - 2) / S);
        }
        return { qlab: qlab, klab: klab, x0: x0, y0: y0, font: font, give: give,
                 cell: clamp(Math.min(byHeight, byWidth), MIN_CELL, MAX_CELL) };
      };
      var h = heat(FONT);
      if (h.cell < 13) h = heat(mono(h.cell - 1));  // rows smaller than the text: smaller text, so more room
      if (g.lines) g.lines.gap -= h.give;
      h.w = h.x0 + S * h.cell + 2;
      h.h = h.y0 + T * h.cell + 2;
      g.heat = h;
      pw = h.w;
    }
    if (g.lines) {
      g.lines.xr = g.lines.xl + g.lines.gap;
      g.lines.w = g.lines.xr + g.lines.xk;
      g.lines.h = g.lines.y0 + Math.max(T, S) * g.lines.row + 6;
      pw += (pw ? pgap : 0) + g.lines.w;
    }
    g.legendW = clamp(pw, MIN_LEGEND, MAX_LEGEND);
    overviewBox.style.width = g.overview.box + "px";
    if (g.table) {
      tableCol.style.width = g.table.box + "px";
      tableSide.hidden = !g.side;
      tableSide.style.width = g.side + "px";
      tableBox.style.width = g.table.box + (g.side ? SIDE_GAP + g.side : 0) + "px";
    }
    return g;
  }

  // ---- heatmap ----------------------------------------------------------------------------------
  function drawHeatmap() {
    if (!geo.heat) return;  // hidden (the lines view)
    var r = run(), T = r.T, S = r.S, g = geo.heat, x0 = g.x0, y0 = g.y0, cell = g.cell;
    var ctx = setup(heatmap, g.w, g.h);
    heatmap.dataset.x0 = x0; heatmap.dataset.y0 = y0; heatmap.dataset.cell = cell;
    heatmap.dataset.rows = T; heatmap.dataset.cols = S;
    var scale = isDiff() ? diffScale() : 0;
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
      ctx.font = h && h.t === t ? "bold " + g.font : g.font;
      ctx.fillText(g.qlab[t], x0 - 5, y0 + (t + 0.5) * cell);
    }
    for (s = 0; s < S; s++) {
      ctx.save();
      ctx.translate(x0 + (s + 0.5) * cell, y0 - 5);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.font = h && h.s === s ? "bold " + g.font : g.font;
      ctx.fillText(g.klab[s], 0, 0);
      ctx.restore();
    }
    if (h && h.t !== undefined && h.s !== undefined && h.t < T && h.s < S) {
      ctx.strokeStyle = "#e8003d";
      ctx.lineWidth = 2;
      ctx.strokeRect(x0 + h.s * cell + 1, y0 + h.t * cell + 1, cell - 2, cell - 2);
    }
  }
  function drawMapsLegend() {
    if (isDiff()) {
      var m = diffScale();
      drawLegend(legend, geo.legendW, DIVERGING, -m, m, "difference (" + RUNS[0].name + " \u2212 " + RUNS[1].name + ")");
    } else if (state.view === "lines") {  // a line's opacity is its weight
      drawLegend(legend, geo.legendW, ["#ffffff", "#1f77b4"], 0, 1, "weight (line opacity)");
    } else {
      drawLegend(legend, geo.legendW, VIRIDIS, 0, 1, "weight");
    }
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
  function drawLines() {
    if (!geo.lines) return;  // hidden (the heatmap view)
    var r = run(), g = geo.lines, T = r.T, S = r.S, row = g.row;
    var ctx = setup(lines, g.w, g.h);
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
      ctx.moveTo(g.xl, g.y0 + (t + 0.5) * row);
      ctx.lineTo(g.xr, g.y0 + (s + 0.5) * row);
      ctx.stroke();
    }
    ctx.fillStyle = "#222";
    for (t = 0; t < T; t++) {
      ctx.textAlign = "right";
      ctx.font = h && h.t === t ? "bold " + g.font : g.font;
      ctx.fillText(g.ql[t], g.xl - 6, g.y0 + (t + 0.5) * row);
    }
    for (s = 0; s < S; s++) {
      ctx.textAlign = "left";
      ctx.font = h && h.s === s ? "bold " + g.font : g.font;
      ctx.fillText(g.kl[s], g.xr + 6, g.y0 + (s + 0.5) * row);
    }
    lines.dataset.xl = g.xl; lines.dataset.xr = g.xr; lines.dataset.y0 = g.y0; lines.dataset.row = row;
  }
  function tokenAt(ev) {  // hovering a query (left) or key (right) token in the lines view
    var r = run(), b = lines.getBoundingClientRect(), g = geo.lines;
    if (!g) return null;
    var x = ev.clientX - b.left, i = Math.floor((ev.clientY - b.top - g.y0) / g.row);
    if (i < 0) return null;
    if (x < g.xl + 20 && i < r.T) return { t: i };
    if (x > g.xr - 20 && i < r.S) return { s: i };
    return null;
  }

  // ---- [L, N] grids: the entropy overview and the table panel -----------------------------------
  function step(cell, room) {  // label every step-th row or column, so that labels `room` px wide do not overlap
    return [1, 2, 5, 10, 20, 50].filter(function (k) { return k * cell >= room; })[0] || 100;
  }
  // The labels of an [L, N] grid of `cell` px cells: every layer ("L29", left of its row) and every head
  // ("h8", above its column), in a font that fits a cell (MIN_LABEL_FONT to MAX_LABEL_FONT px); a head
  // label wider than its column is written upwards. Each label's box lies within its own row or column,
  // so no two overlap. Only cells too small for the smallest font label every step-th layer or head.
  function gridLabels(L, N, cell) {
    var size = clamp(cell - 3, MIN_LABEL_FONT, MAX_LABEL_FONT), font = size + "px sans-serif";
    var thick = Math.min(cell - 1, size + 3);  // a label's box across its row or column
    var lw = widest(["L" + (L - 1)], font), hw = widest(["h" + (N - 1)], font);
    var every = cell - 1 >= MIN_LABEL_FONT + 2;
    var upright = every && hw + 2 <= cell - 1;
    return { font: font, size: size, thick: Math.max(1, thick), lw: lw, hw: hw, upright: !every || upright,
             layerStep: every ? 1 : step(cell, 11), headStep: every ? 1 : step(cell, hw + 4),
             x0: lw + 10, y0: !every || upright ? GRID_Y0 : hw + 10 };
  }
  function placeLabels(box, g) {
    var lab = g.lab, c = g.cell, parts = [], l, n;
    box.textContent = "";
    box.style.font = lab.font;
    for (l = 0; l < g.L; l += lab.layerStep) {
      var e = el("span", { "class": "layer-label", "data-layer": l }, "L" + l);
      e.style.cssText = "left:" + (g.x0 - 6 - lab.lw) + "px;width:" + (lab.lw + 2) + "px;top:" + (g.y0 + l * c + (c - lab.thick) / 2) + "px;height:" +
        lab.thick + "px;line-height:" + lab.thick + "px";
      parts.push(e);
    }
    for (n = 0; n < g.N; n += lab.headStep) {
      var h = el("span", { "class": "head-label" + (lab.upright ? "" : " upwards"), "data-head": n }, "h" + n);
      if (lab.upright) {
        var w = lab.headStep > 1 ? lab.hw + 2 : c - 1;
        h.style.cssText = "left:" + (g.x0 + n * c + (c - 1 - w) / 2) + "px;top:2px;width:" + w + "px;height:" +
          (GRID_Y0 - 4) + "px;line-height:" + (GRID_Y0 - 4) + "px";
      } else {
        h.style.cssText = "left:" + (g.x0 + n * c + (c - lab.thick) / 2) + "px;top:" + (g.y0 - 4 - lab.hw - 2) +
          "px;width:" + lab.thick + "px;height:" + (lab.hw + 2) + "px;line-height:" + lab.thick + "px";
      }
      parts.push(h);
    }
    parts.forEach(function (e) { box.appendChild(e); });
  }
  function drawGrid(canvas, labelBox, g, colourAt, highlight) {
    var ctx = setup(canvas, g.w, g.y0 + g.L * g.cell + 2), l, n, inset = g.cell >= 8 ? 1 : 0;
    for (l = 0; l < g.L; l++) for (n = 0; n < g.N; n++) {
      ctx.fillStyle = colourAt(l, n);
      ctx.fillRect(g.x0 + n * g.cell, g.y0 + l * g.cell, g.cell - inset, g.cell - inset);
    }
    if (labelBox.dataset.key !== [g.L, g.N, g.cell, g.w].join()) {
      placeLabels(labelBox, g);
      labelBox.dataset.key = [g.L, g.N, g.cell, g.w].join();
    }
    if (highlight) {
      ctx.strokeStyle = "#e8003d";
      ctx.lineWidth = 2;
      ctx.strokeRect(g.x0 + state.head * g.cell, g.y0 + state.layer * g.cell, g.cell - inset, g.cell - inset);
    }
    canvas.dataset.x0 = g.x0; canvas.dataset.y0 = g.y0; canvas.dataset.cell = g.cell;
    canvas.dataset.rows = g.L; canvas.dataset.cols = g.N;
  }

  function entropyValue(l, n) {
    if (!isDiff()) { var r = run(); return l < r.L && n < r.N ? r.entropy[l][n] : null; }
    return RUNS[0].entropy[l][n] - RUNS[1].entropy[l][n];
  }
  function drawOverview() {
    var g = geo.overview;
    // Colours span the heads' range: [min, max] of the entropies, or [-m, m] for their differences.
    var vmin = Infinity, vmax = -Infinity, l, n, v;
    for (l = 0; l < g.L; l++) for (n = 0; n < g.N; n++) {
      v = entropyValue(l, n);
      if (v === null) continue;
      vmin = Math.min(vmin, isDiff() ? -Math.abs(v) : v);
      vmax = Math.max(vmax, Math.abs(v));
    }
    if (isDiff()) { vmax = Math.max(vmax, 1e-6); vmin = -vmax; }
    // every head alike: the middle colour and a bar at that value (as a table's flat scale); none: no labels
    if (vmin === Infinity) { vmin = NaN; vmax = NaN; }
    var palette = isDiff() ? DIVERGING : VIRIDIS;
    overviewTitle.textContent = isDiff() ? "entropy difference" : "entropy per head";
    overviewTitle.title = isDiff() ? "mean row entropy of each head (nats), " + RUNS[0].name + " \u2212 " + RUNS[1].name
                                   : "mean row entropy of each head (nats), " + run().name + "; click a head to show it";
    drawGrid(overview, overviewLabels, g, function (l, n) {
      var v = entropyValue(l, n);
      return v === null ? MASKED : ramp(palette, scaled(v, vmin, vmax));
    }, true);
    drawLegend(overviewLegend, g.legendW, palette, vmin, vmax, isDiff() ? "entropy difference (nats)" : "mean row entropy (nats)");
  }

  function drawTable() {
    var table = TABLES[state.table], sc = tableScale(table);
    tableSel[1].title = table.name;
    drawGrid(tableGrid, tableLabels, geo.table, function (l, n) {
      var v = table.values[l][n];
      return v === null ? MASKED : ramp(sc.palette, scaled(v, sc.lo, sc.hi));
    }, headsOfA());
    if (geo.side) drawTop(table);
    tableGrid.dataset.scale = sc.kind;
    drawLegend(tableLegend, geo.table.legendW, sc.palette, sc.lo, sc.hi, table.name + (sc.kind === "none" ? " (no values)" : ""));
  }

  // A table's TOP heads of largest |value|, largest first (ties: the earlier head, layer by layer); no NaN.
  function topHeads(table) {
    if (table.top) return table.top;
    var heads = [];
    table.values.forEach(function (row, l) {
      row.forEach(function (v, n) { if (v !== null) heads.push({ layer: l, head: n, value: v }); });
    });
    heads.sort(function (a, b) { return Math.abs(b.value) - Math.abs(a.value); });  // a stable sort
    table.top = heads.slice(0, TOP);
    return table.top;
  }
  function topText(h) { return "L" + h.layer + " H" + h.head + ": " + num(h.value); }
  var TOP_FONT = "11px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
  function sideWidth() {  // the list's width: its widest entry over every table (the name wraps to it)
    var texts = [];
    TABLES.forEach(function (t) { topHeads(t).forEach(function (h) { texts.push(topText(h)); }); });
    return clamp((texts.length ? widest(texts, TOP_FONT) : 0) + 16, 110, 220);
  }
  function drawTop(table) {
    var heads = topHeads(table), current = headsOfA();
    tableName.textContent = table.name;
    tableName.title = table.name;
    tableTop.textContent = "";
    tableTop.setAttribute("aria-label", "the " + heads.length + " heads of largest |value| in " + table.name);
    heads.forEach(function (h, i) {
      var b = el("button", { type: "button", "class": "top-entry", "data-layer": h.layer, "data-head": h.head,
                             "data-value": String(h.value), "data-rank": i, title: table.name + " = " + h.value +
                             " (click to show)" }, topText(h));
      if (current && h.layer === state.layer && h.head === state.head) b.setAttribute("aria-current", "true");
      var li = el("li");
      li.appendChild(b);
      tableTop.appendChild(li);
    });
    if (!heads.length) tableTop.appendChild(el("li", { "class": "none" }, "no values"));
  }

  function drawLegend(canvas, w, palette, lo, hi, label) {  // a colour bar from lo to hi (NaN: none), w CSS px wide
    var pad = 6, bar = w - 2 * pad, ctx = setup(canvas, w, LEGEND_H);
    for (var i = 0; i < bar; i++) {
      ctx.fillStyle = ramp(palette, i / (bar - 1));
      ctx.fillRect(pad + i, 4, 1, 12);
    }
    ctx.fillStyle = "#222";
    ctx.font = SMALL;
    ctx.textBaseline = "top";
    [["left", pad, lo], ["center", w / 2, mid(lo, hi)], ["right", w - pad, hi]].forEach(function (p) {
      if (isNaN(p[2])) return;
      ctx.textAlign = p[0];
      ctx.fillText(digits(p[2], 3), p[1], 19);
    });
    ctx.textAlign = "left";
    ctx.fillText(fitText(label, bar, SMALL), pad, 31);
    canvas.setAttribute("aria-label", label + " colour scale from " + lo + " to " + hi);
    canvas.dataset.lo = lo; canvas.dataset.hi = hi;
  }

  // ---- tooltip ----------------------------------------------------------------------------------
  function showTip(ev, text, attrs) {  // beside the pointer, kept inside the viewport
    tooltip.textContent = text;
    Array.prototype.slice.call(tooltip.attributes).forEach(function (a) {
      if (a.name.indexOf("data-") === 0) tooltip.removeAttribute(a.name);
    });
    Object.keys(attrs).forEach(function (k) { tooltip.setAttribute("data-" + k, String(attrs[k])); });
    tooltip.hidden = false;
    tooltip.style.left = "0px";
    tooltip.style.top = "0px";
    var b = tooltip.getBoundingClientRect(), root = document.documentElement;
    var x = ev.clientX + 14, y = ev.clientY + 14;
    if (x + b.width > root.clientWidth) x = Math.max(0, root.clientWidth - b.width);
    if (y + b.height > root.clientHeight) y = Math.max(0, ev.clientY - 14 - b.height);
    tooltip.style.left = x + "px";
    tooltip.style.top = y + "px";
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
  function draw() {
    geo = layout();
    drawOverview();
    if (TABLES.length) drawTable();
    if (!heatmap.hidden) drawHeatmap();
    if (!lines.hidden) drawLines();
    drawMapsLegend();
  }
  function redraw() {
    var r = run();
    mapsTitle.textContent = (isDiff() ? "difference " + RUNS[0].name + " \u2212 " + RUNS[1].name : r.name) +
      ": layer " + state.layer + ", head " + state.head + " (rows: queries, columns: keys)";
    mapsTitle.title = mapsTitle.textContent;
    heatmap.hidden = state.view === "lines";
    lines.hidden = state.view === "heatmap";
    draw();
    // A scrollbar that came or went changed the width the layout had: lay out once more.
    if (document.documentElement.clientWidth !== geo.root) draw();
    document.body.dataset.layer = state.layer;
    document.body.dataset.head = state.head;
    document.body.dataset.mode = state.mode;
    document.body.dataset.view = state.view;
    document.body.dataset.table = state.table;
  }
  function fill(sel, n, keep) {
    var old = Number(keep);
    sel.innerHTML = "";
    range(n, "").forEach(function (o) { sel.appendChild(el("option", { value: o[0] }, o[1])); });
    sel.value = String(Math.min(old, n - 1));
    return Number(sel.value);
  }
  function setMode(mode) {
    state.mode = mode;
    modeSel[1].value = mode;
    var r = run();
    state.layer = fill(layerSel[1], r.L, state.layer);
    state.head = fill(headSel[1], r.N, state.head);
  }
  function selectHead(l, n) {  // what a click in the entropy overview or the table panel does
    state.layer = l; state.head = n; state.hover = null;
    layerSel[1].value = String(l);
    headSel[1].value = String(n);
    redraw();
  }
  layerSel[1].addEventListener("change", function () { state.layer = Number(layerSel[1].value); state.hover = null; redraw(); });
  headSel[1].addEventListener("change", function () { state.head = Number(headSel[1].value); state.hover = null; redraw(); });
  viewSel[1].addEventListener("change", function () { state.view = viewSel[1].value; state.hover = null; redraw(); });
  tableSel[1].addEventListener("change", function () { state.table = Number(tableSel[1].value); hideTip(); redraw(); });
  modeSel[1].addEventListener("change", function () {
    setMode(modeSel[1].value);
    state.hover = null;
    hideTip();
    redraw();
  });
  window.addEventListener("resize", function () { hideTip(); redraw(); });
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
  overview.addEventListener("mousemove", function (ev) {
    var c = cellAt(overview, ev);
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
    var c = cellAt(overview, ev);
    if (c) selectHead(c.t, c.s);
  });
  tableGrid.addEventListener("mousemove", function (ev) {
    var c = cellAt(tableGrid, ev);
    if (!c) { hideTip(); return; }
    var table = TABLES[state.table], v = table.values[c.t][c.s];
    showTip(ev, "layer " + c.t + ", head " + c.s + ": " + table.name + (v === null ? ": no value" : " = " + num(v)) +
            " (click to show)", { layer: c.t, head: c.s, table: table.name, value: v === null ? "NaN" : String(v) });
  });
  tableGrid.addEventListener("mouseleave", hideTip);
  tableGrid.addEventListener("click", function (ev) {  // a head of A: from another input of other shape, back to A
    var c = cellAt(tableGrid, ev);
    if (!c) return;
    if (!headsOfA()) setMode("0");
    selectHead(c.t, c.s);
  });
  tableTop.addEventListener("click", function (ev) {  // an entry of the list: the same as a click on its cell
    var b = ev.target.closest ? ev.target.closest("button") : null;
    if (!b) return;
    if (!headsOfA()) setMode("0");
    hideTip();
    selectHead(Number(b.dataset.layer), Number(b.dataset.head));
  });
  document.addEventListener("keydown", function (ev) {  // arrow keys step through heads and layers
    if (ev.target && ev.target.tagName === "SELECT") return;
    var r = run(), l = state.layer, n = state.head;
    if (ev.key === "ArrowRight") n = (n + 1) % r.N;
    else if (ev.key === "ArrowLeft") n = (n + r.N - 1) % r.N;
    else if (ev.key === "ArrowDown") l = (l + 1) % r.L;
    else if (ev.key === "ArrowUp") l = (l + r.L - 1) % r.L;
    else return;
    ev.preventDefault();
    selectHead(l, n);
  });
  redraw();
  document.body.dataset.ready = "true";
})();
