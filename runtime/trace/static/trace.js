(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("dlm-trace").textContent);
  var root = document.getElementById("app");
  var SKIP = { pred: 1, status: 1, held: 1, entropy: 1, confidence: 1, after: 1, replaced: 1 };
  // LLaDA2.2's edit tokens: one fixed colour each (outside the green-red scale), as in trace.css.
  var SOLID = { deleted: "#c23bbf", inserted: "#1c9fc7" };

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    if (typeof v === "number") {
      if (Number.isInteger(v) || Math.abs(v) >= 100) return String(v);
      return v !== 0 && Math.abs(v) < 1e-3 ? v.toExponential(2) : v.toPrecision(3);
    }
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }
  function plural(unit, n) { return n === 1 ? unit : (unit === "canvas" ? "canvases" : unit + "s"); }
  function tokText(trace, id) {
    var t = trace.vocab[String(id)];
    if (t === undefined) t = "#" + id;
    if (t === "") return "\u2205";
    t = t.replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5");
    return /^ +$/.test(t) ? t.replace(/ /g, "\u2423") : t;
  }
  function joined(trace, ids) {
    return (ids || []).map(function (i) { var t = trace.vocab[String(i)]; return t === undefined ? "#" + i : t; })
      .join("");
  }
  // Colour: entropy (low = green, high = red) or confidence (high = green, low = red).
  function scaleOf(trace) {
    var key = null, top = 1;
    trace.canvases.forEach(function (c) {
      c.records.forEach(function (r) {
        if (!key) key = r.entropy ? "entropy" : (r.confidence ? "confidence" : null);
        if (r.entropy) r.entropy.forEach(function (v) { if (v !== null && v > top) top = v; });
      });
    });
    return { key: key, top: top };
  }
  function hue(scale, rec, p) {
    if (!scale.key || !rec[scale.key]) return null;
    var v = rec[scale.key][p];
    if (v === null || v === undefined) return null;
    var good = scale.key === "entropy" ? 1 - Math.log1p(v) / Math.log1p(scale.top) : v;
    return Math.round(130 * Math.max(0, Math.min(1, good)));
  }
  function colour(h, alpha) { return h === null ? "#eee" : "hsla(" + h + ",70%,62%," + alpha + ")"; }

  function kvTable(obj, prefix, table, skip) {
    table = table || el("div", "kv");
    Object.keys(obj || {}).forEach(function (k) {
      var v = obj[k], name = prefix ? prefix + "." + k : k;
      if (skip && skip[k]) return;
      if (v && typeof v === "object" && !Array.isArray(v)) { kvTable(v, name, table); return; }
      var item = el("div");
      item.appendChild(el("span", null, name));
      item.appendChild(document.createTextNode(fmt(v)));
      item.title = name + " = " + fmt(v);
      table.appendChild(item);
    });
    return table;
  }
  function settingsBox(settings) {
    var box = el("div");
    box.appendChild(kvTable(settings, "", null, { resolved: 1 }));
    if (settings && settings.resolved) {
      var det = el("details");
      det.open = true;
      det.appendChild(el("summary", null, "what the options resolved to (with generation_config.json)"));
      det.appendChild(kvTable(settings.resolved, ""));
      box.appendChild(det);
    }
    return box;
  }
  function panel(title, child) {
    var p = el("div", "panel");
    p.appendChild(el("h3", null, title));
    p.appendChild(child);
    return p;
  }
  function textBlock(text, none) {
    return text ? el("div", "text", text) : el("div", "text empty", none);
  }

  function header(trace, parent, label) {
    var box = el("div");
    if (label) box.appendChild(el("h2", null, label));
    var panels = el("div", "panels");
    panels.appendChild(panel("Run settings", settingsBox(trace.settings || {})));
    if (trace.profile && trace.profile.length) {
      panels.appendChild(panel("Profile", el("pre", null, trace.profile.join("\n"))));
    }
    box.appendChild(panels);
    var texts = el("div", "panels");
    if (trace.prompt) {
      var prompt = trace.prompt.text || (trace.prompt.ids || []).join(",");
      texts.appendChild(panel("Prompt", textBlock(prompt, "(empty)")));
    }
    texts.appendChild(panel("Committed text (answer)", textBlock(trace.answer, "(no answer text)")));
    texts.appendChild(panel("Reasoning (thinking channel)", textBlock(trace.reasoning, "(no reasoning)")));
    box.appendChild(texts);
    parent.appendChild(box);
  }

  function legend(trace, scale, parent) {
    var lg = el("div", "legend");
    trace.status_names.forEach(function (n) { lg.appendChild(el("span", "tok st-" + n, n)); });
    if (scale.key) {
      var bar = el("span", "scale");
      var stops = [0, .25, .5, .75, 1].map(function (g) { return "hsl(" + Math.round(130 * g) + ",70%,62%)"; });
      bar.style.background = "linear-gradient(to right," + stops.join(",") + ")";
      lg.appendChild(el("span", null, scale.key === "entropy" ? "entropy: high" : "confidence: low"));
      lg.appendChild(bar);
      lg.appendChild(el("span", null, scale.key === "entropy" ? "low (max " + fmt(scale.top) + " nats)" : "high"));
    }
    lg.appendChild(el("span", null, "faded: the model's prediction where the position holds noise or a mask"));
    if (trace.status_names.indexOf("deleted") >= 0) {
      lg.appendChild(el("span", null, "deleted: DELETE written, the position drops out; inserted: SPLIT written, " +
        "a mask goes in before the token it held; the row under a step: the block once they shifted it"));
    }
    parent.appendChild(lg);
  }

  // One side (trace) of one canvas: an overview heatmap and the token grid.
  function Side(trace, scale, canvas, parent, onPick) {
    this.trace = trace; this.scale = scale; this.canvas = canvas;
    var L = canvas.length, n = Math.max(1, canvas.records.length);
    this.cw = Math.max(2, Math.min(28, Math.floor(1100 / Math.max(1, L))));
    this.rh = Math.max(2, Math.min(14, Math.floor(320 / n)));
    var cv = el("canvas", "overview");
    cv.width = L * this.cw; cv.height = n * this.rh;
    cv.title = "rows: denoising steps (top: first), columns: positions; click a row to show that step";
    var self = this;
    cv.addEventListener("click", function (ev) {
      var r = cv.getBoundingClientRect();
      onPick(Math.floor((ev.clientY - r.top) / r.height * n));
    });
    this.cv = cv;
    parent.appendChild(cv);
    this.grid = el("div", "grid");
    parent.appendChild(this.grid);
    this.cells = [];
    for (var p = 0; p < L; p++) { var c = el("span", "tok"); this.cells.push(c); this.grid.appendChild(c); }
    this.afterCells = [];
    if (canvas.records.some(function (r) { return r.after; })) this.afterRow(parent, L);
    this.drawOverview(-1, null);
  }
  // LLaDA2.2: the block after the step's DELETE/SPLIT shifted it, under the step's own grid.
  Side.prototype.afterRow = function (parent, L) {
    var row = el("div", "after");
    row.appendChild(el("span", "afterlabel", "after the shift:"));
    var grid = el("div", "grid");
    for (var p = 0; p < L; p++) { var c = el("span", "tok"); this.afterCells.push(c); grid.appendChild(c); }
    row.appendChild(grid);
    parent.appendChild(row);
  };
  Side.prototype.showAfter = function (rec) {
    var after = rec && rec.after, trace = this.trace, c = this.canvas;
    for (var p = 0; p < this.afterCells.length; p++) {
      var cell = this.afterCells[p];
      if (!after) { cell.textContent = ""; cell.className = "tok"; cell.title = ""; continue; }
      var id = after[p], st = p < (c.output_from || 0) ? "prompt" : (id === c.mask_id ? "masked" : "kept");
      var moved = id !== rec.pred[p], shown = JSON.stringify(tokText(trace, rec.pred[p]));
      cell.textContent = tokText(trace, id);
      cell.className = "tok st-" + st + (moved ? " shifted" : "");
      cell.title = "position " + p + " after the shift \u00b7 " + JSON.stringify(tokText(trace, id)) +
        " (id " + id + ")" + (moved ? " \u00b7 the step showed " + shown + " here" : "");
    }
  };
  // What a written position held before the step, in words (LLaDA2.2's "replaced").
  function editNote(trace, st, was) {
    var old = was === undefined ? null : JSON.stringify(tokText(trace, was)) + " (id " + was + ")";
    if (st === "deleted") return " \u00b7 drops this position, which held " + (old || "a mask");
    if (st === "inserted") return " \u00b7 inserts a mask before " + (old || "the mask it held");
    return old ? " \u00b7 was " + old : "";
  }
  // Positions that did not reach the output (after a stop token, past the budget).
  Side.prototype.outside = function (p) {
    var c = this.canvas, from = c.output_from || 0;
    if (c.output_from === null) return false;  // not known (dlm-verify's LLaDA-2 blocks)
    if (c.committed) return p >= from + c.committed.length;
    return c.output_to !== undefined && c.output_to !== null && p >= c.output_to;
  };
  Side.prototype.status = function (rec, p) { return this.trace.status_names[+rec.status[p]] || "?"; };
  Side.prototype.drawOverview = function (sel, mark) {
    var ctx = this.cv.getContext("2d"), cw = this.cw, rh = this.rh, self = this;
    ctx.clearRect(0, 0, this.cv.width, this.cv.height);
    this.canvas.records.forEach(function (rec, s) {
      for (var p = 0; p < rec.pred.length; p++) {
        var st = self.status(rec, p), faded = st === "renoised" || st === "masked";
        ctx.fillStyle = st === "prompt" ? "#d5d9de" : SOLID[st] || colour(hue(self.scale, rec, p), faded ? 0.35 : 1);
        ctx.fillRect(p * cw, s * rh, cw, rh);
      }
    });
    if (sel >= 0) {
      ctx.strokeStyle = "#1d232b"; ctx.lineWidth = 1;
      ctx.strokeRect(0.5, sel * rh + 0.5, this.cv.width - 1, rh - 1);
    }
    if (mark) {
      ctx.strokeStyle = "#d12b2b"; ctx.lineWidth = 2;
      ctx.strokeRect(mark.position * cw - 1, mark.step * rh - 1, cw + 2, rh + 2);
    }
  };
  Side.prototype.shown = function (s) {
    var rec = this.canvas.records[Math.min(s, this.canvas.records.length - 1)];
    if (!rec) return null;
    var held = {}, replaced = {};
    (rec.held || []).forEach(function (h) { held[h[0]] = h[1]; });
    (rec.replaced || []).forEach(function (h) { replaced[h[0]] = h[1]; });
    return { rec: rec, held: held, replaced: replaced };
  };
  Side.prototype.show = function (s, other, mark) {
    var sh = this.shown(s), trace = this.trace, c = this.canvas;
    this.drawOverview(Math.min(s, c.records.length - 1), mark);
    var osh = other ? other.shown(s) : null;
    for (var p = 0; p < this.cells.length; p++) {
      var cell = this.cells[p];
      if (!sh) { cell.textContent = ""; continue; }
      var rec = sh.rec, st = this.status(rec, p), id = (p in sh.held) ? sh.held[p] : rec.pred[p];
      cell.textContent = tokText(trace, id);
      cell.className = "tok st-" + st;
      if (this.outside(p)) cell.className += " out-trimmed";
      var h = hue(this.scale, rec, p);
      var faded = st === "renoised" || st === "masked";
      cell.style.background = st === "prompt" || SOLID[st] ? "" : colour(h, faded ? 0.45 : 0.9);
      if (osh && osh.rec.pred[p] !== rec.pred[p]) cell.className += " differs";
      if (mark && mark.step === s && mark.position === p) cell.className += " diverge";
      var tip = "position " + p + " \u00b7 " + JSON.stringify(tokText(trace, id)) + " (id " + id + ") \u00b7 " + st;
      if (p in sh.held) {
        tip += " \u00b7 model predicts " + JSON.stringify(tokText(trace, rec.pred[p])) + " (id " + rec.pred[p] + ")";
      }
      tip += editNote(trace, st, sh.replaced[p]);
      if (rec.entropy) tip += " \u00b7 entropy " + fmt(rec.entropy[p]);
      if (rec.confidence) tip += " \u00b7 confidence " + fmt(rec.confidence[p]);
      cell.title = tip;
    }
    if (this.afterCells.length) this.showAfter(sh && sh.rec);
  };
  Side.prototype.info = function (s) {
    var c = this.canvas, rec = c.records[s];
    if (!rec) return c.records.length ? "ended at step " + c.records.length : "no steps";
    var counts = {}, parts = ["step " + (s + 1) + " / " + c.records.length];
    for (var p = 0; p < rec.status.length; p++) { var n = this.status(rec, p); counts[n] = (counts[n] || 0) + 1; }
    Object.keys(rec).forEach(function (k) { if (!SKIP[k]) parts.push(k.replace(/_/g, " ") + " " + fmt(rec[k])); });
    Object.keys(counts).forEach(function (k) { parts.push(k + ": " + counts[k]); });
    return parts.join(" \u00b7 ");
  };

  function reasonText(trace, c) {
    var budget = c.iteration_cap ?
      " (masks filled over " + c.step_budget + " steps, at most " + c.iteration_cap + ")" :
      (c.step_budget ? " (step budget " + c.step_budget + ")" : "");
    var out = "stopped after " + c.records.length + " step" + (c.records.length === 1 ? "" : "s") + budget;
    if (c.stop_reason) out += ": " + (trace.stop_reasons[c.stop_reason] || c.stop_reason);
    if (c.ends_output === "eos") out += "; the output ends here (stop token)";
    if (c.ends_output === "budget") out += "; the output ends here (token budget)";
    return out;
  }

  // A canvas/block section with one or two sides sharing one step slider.
  function section(traces, labels, index, scales, mark) {
    var canvases = traces.map(function (t) { return t.canvases[index]; });
    var first = canvases.filter(Boolean)[0];
    var unit = traces[0].unit || "canvas";
    var sec = el("section", "canvas");
    var h = el("h2", null, unit.charAt(0).toUpperCase() + unit.slice(1) + " " + (index + 1) + " ");
    if (traces.length === 1) h.appendChild(el("span", "reason", reasonText(traces[0], first)));
    sec.appendChild(h);
    var steps = Math.max.apply(null, canvases.map(function (c) { return c ? c.records.length : 0; }));
    var controls = el("div", "controls");
    var prev = el("button", null, "\u25c0"), next = el("button", null, "\u25b6");
    var slider = el("input"); slider.type = "range"; slider.min = 1; slider.max = Math.max(1, steps);
    var label = el("span", "stepinfo");
    controls.appendChild(prev); controls.appendChild(slider); controls.appendChild(next); controls.appendChild(label);
    sec.appendChild(controls);
    var row = el("div", traces.length > 1 ? "sides" : ""), sides = [], infos = [];
    function pick(s) { slider.value = Math.max(0, Math.min(steps - 1, s)) + 1; update(); }
    traces.forEach(function (t, i) {
      var col = el("div", traces.length > 1 ? "side" : "");
      if (traces.length > 1) {
        col.appendChild(el("h3", null, labels[i]));
        var inf = el("div", "stepinfo"); col.appendChild(inf); infos.push(inf);
        if (canvases[i]) col.appendChild(el("div", "stepinfo", reasonText(t, canvases[i])));
      }
      sides.push(canvases[i] ? new Side(t, scales[i], canvases[i], col, pick) : null);
      if (!canvases[i]) col.appendChild(el("div", "text empty", "(no such " + unit + " on this side)"));
      row.appendChild(col);
    });
    sec.appendChild(row);
    var committed = el("div", "committed");
    traces.forEach(function (t, i) {
      if (!canvases[i]) return;
      var line = el("div");
      line.appendChild(el("span", null, (traces.length > 1 ? labels[i] + " committed: " : "committed: ")));
      line.appendChild(el("span", "text", JSON.stringify(joined(t, canvases[i].committed))));
      committed.appendChild(line);
    });
    sec.appendChild(committed);
    var here = mark && mark.block === index && mark.step !== null ? mark : null;
    function update() {
      var s = (+slider.value) - 1;
      sides.forEach(function (side, i) {
        if (!side) return;
        var other = sides.length > 1 ? sides[1 - i] : null;
        side.show(s, other, here);
        if (infos.length) infos[i].textContent = side.info(s);
      });
      if (!infos.length && sides[0]) label.textContent = sides[0].info(s);
      else label.textContent = "step " + (s + 1) + " / " + steps;
    }
    prev.addEventListener("click", function () { pick((+slider.value) - 2); });
    next.addEventListener("click", function () { pick(+slider.value); });
    slider.addEventListener("input", update);
    slider.value = here ? here.step + 1 : steps;
    update();
    root.appendChild(sec);
  }

  function single(trace) {
    root.appendChild(el("h1", null, trace.title || "dlm denoising trace"));
    root.appendChild(el("div", "sub", [trace.family, trace.model, "finish: " + fmt(trace.finish_reason),
      trace.canvases.length + " " + plural(trace.unit || "canvas", trace.canvases.length)]
      .filter(Boolean).join(" \u00b7 ")));
    header(trace, root);
    var scale = scaleOf(trace);
    legend(trace, scale, root);
    trace.canvases.forEach(function (c, i) { section([trace], [""], i, [scale], null); });
  }

  function pair(data) {
    var sides = data.sides, labels = data.labels || ["left", "right"];
    root.appendChild(el("h1", null, data.title || "dlm parity trace"));
    root.appendChild(el("div", "sub", data.subtitle || ""));
    var d = data.divergence;
    if (d) {
      var b = el("div", "banner");
      var where = sides[0].unit + " " + (d.block + 1) + (d.step !== null ? ", step " + (d.step + 1) : "") +
        (d.position >= 0 ? ", position " + d.position : "");
      b.appendChild(el("strong", null, "First divergence: " + where + ". "));
      var tokens = d.position >= 0 && d.reference_token >= 0 ?
        labels[0] + " " + JSON.stringify(tokText(sides[0], d.reference_token)) + " (id " + d.reference_token + ") vs " +
        labels[1] + " " + JSON.stringify(tokText(sides[1], d.mlx_token)) + " (id " + d.mlx_token + "). " : "";
      b.appendChild(el("span", null, tokens + (d.reason || "")));
      root.appendChild(b);
    }
    var panels = el("div", "panels");
    panels.appendChild(panel("Settings", settingsBox(data.settings || {})));
    if (sides[0].prompt) panels.appendChild(panel("Prompt", textBlock(sides[0].prompt.text, "(empty)")));
    root.appendChild(panels);
    var scales = sides.map(scaleOf);
    legend(sides[0], scales[0], root);
    var n = Math.max(sides[0].canvases.length, sides[1].canvases.length);
    for (var i = 0; i < n; i++) section(sides, labels, i, scales, d);
  }

  if (DATA.format === "dlm-trace-pair/1") pair(DATA); else single(DATA);
  document.body.setAttribute("data-rendered", "1");
})();
