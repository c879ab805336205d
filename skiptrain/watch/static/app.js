// The skiptrain dashboard: fetches /state.json about once a second and draws it (inline SVG, no
// library).  Every element carries its facts as data-* attributes (data-node, data-state,
// data-kind, data-events), so a headless browser's DOM can be checked.
"use strict";

const KIND_COLOR = { fwd: "#4a90d9", bwd: "#e0823d", loss: "#8e44ad", send: "#9aa5b1", recv: "#c5ccd3", sync: "#2e9e6a" };
const EVENT_COLOR = { failed: "#d62728", joined: "#1f77b4", refused: "#7f7f7f", join_cancelled: "#bcbd22",
  restart: "#17becf", replan: "#9467bd", freeze: "#2ca02c", undo: "#ff7f0e", checkpoint: "#8c564b" };
const SVGNS = "http://www.w3.org/2000/svg";
let updates = 0;

function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
function fmt(x, d = 3) { return x === null || x === undefined ? "-" : Number(x).toFixed(d); }
function mib(b) { return b === null || b === undefined ? "-" : (b / 1048576).toFixed(1) + " MiB"; }

function drawSwarm(st) {
  const box = clear(document.getElementById("swarm"));
  const nStages = Math.max(st.placement.length, 1 + Math.max(-1, ...st.nodes.flatMap(n => n.stages)));
  const cols = [];
  for (let s = 0; s < nStages; s++) {
    const col = el("div", { class: "stage", "data-stage": s });
    col.appendChild(el("h4", {}, s === 0 ? "stage 0 (originators)" : `stage ${s}`));
    box.appendChild(col); cols.push(col);
  }
  const loose = el("div", { class: "stage", "data-stage": "none" });
  loose.appendChild(el("h4", {}, "no stage"));
  for (const n of st.nodes) {
    const d = el("div", { class: "node", "data-node": n.node, "data-state": n.state, "data-stages": n.stages.join("+") });
    d.appendChild(el("b", {}, `node ${n.node}`));
    d.appendChild(el("span", {}, ` ${n.state}`));
    const lease = n.lease_age_s === null ? "lease -" : `lease ${fmt(n.lease_age_s, 1)}/${n.lease_s} s`;
    d.appendChild(el("div", {}, `${n.host || "?"} · ${lease} · it ${n.last_iteration ?? "-"}`));
    (n.stages.length ? cols[n.stages[0]] : loose).appendChild(d);
  }
  if (loose.children.length > 1) box.appendChild(loose);
  box.setAttribute("data-nodes", st.nodes.length);
}

function drawGantt(id, tl, nodes) {
  const svg = clear(document.getElementById(id));
  const events = tl ? tl.events : [];
  svg.setAttribute("data-events", events.length);
  if (!events.length) { svg.appendChild(el("svg:text", { x: 10, y: 20 }, "no iteration recorded yet")); return; }
  const end = Math.max(...events.map(e => e[4])) || 1;
  const rowH = Math.max(8, Math.min(22, 180 / nodes.length));
  svg.setAttribute("viewBox", `0 0 640 ${nodes.length * rowH + 24}`);
  nodes.forEach((n, i) => svg.appendChild(el("svg:text", { x: 2, y: i * rowH + rowH * 0.7 }, `n${n}`)));
  for (const [node, kind, stage, start, stop] of events) {
    const i = nodes.indexOf(node); if (i < 0) continue;
    const y = i * rowH + (kind === "send" || kind === "recv" ? rowH * 0.55 : 1);
    const h = kind === "send" || kind === "recv" ? rowH * 0.35 : rowH * 0.55;
    const r = el("svg:rect", { x: 30 + 600 * start / end, y, width: Math.max(0.5, 600 * (stop - start) / end), height: h,
      fill: KIND_COLOR[kind] || "#999", "data-kind": kind });
    r.appendChild(el("svg:title", {}, `node ${node} ${kind} stage ${stage}: ${fmt(start, 4)}-${fmt(stop, 4)} s`));
    svg.appendChild(r);
  }
  svg.appendChild(el("svg:text", { x: 30, y: nodes.length * rowH + 16 }, "0 s"));
  svg.appendChild(el("svg:text", { x: 580, y: nodes.length * rowH + 16 }, `${fmt(end, 3)} s`));
}

function drawLoss(id, st, xi) {
  const svg = clear(document.getElementById(id));
  const pts = st.loss.filter(p => p[xi] !== null), val = st.val.filter(p => p[xi] !== null);
  const evs = st.events.filter(e => (xi === 0 ? e.tokens : e.time) !== null);
  svg.setAttribute("data-points", pts.length);
  svg.setAttribute("data-events", evs.length);
  if (!pts.length) { svg.appendChild(el("svg:text", { x: 10, y: 20 }, "no iteration yet")); return; }
  const all = pts.concat(val), xs = all.map(p => p[xi]).concat(evs.map(e => xi === 0 ? e.tokens : e.time));
  const x0 = Math.min(...xs), x1 = Math.max(...xs) || 1, ys = all.map(p => p[2]);
  const y0 = Math.min(...ys), y1 = Math.max(...ys);
  const X = x => 40 + 590 * (x - x0) / ((x1 - x0) || 1), Y = y => 10 + 220 * (y1 - y) / ((y1 - y0) || 1);
  svg.appendChild(el("svg:polyline", { points: pts.map(p => `${X(p[xi])},${Y(p[2])}`).join(" "), fill: "none",
    stroke: "#4a90d9", "stroke-width": 1.2, "data-series": "train" }));
  for (const p of val) svg.appendChild(el("svg:circle", { cx: X(p[xi]), cy: Y(p[2]), r: 3.5, fill: "#e0823d", "data-series": "val" }));
  for (const e of evs) {
    const x = X(xi === 0 ? e.tokens : e.time);
    const g = el("svg:g", { class: "event", "data-kind": e.kind, "data-node": e.node ?? "" });
    g.appendChild(el("svg:line", { x1: x, x2: x, y1: 8, y2: 232, stroke: EVENT_COLOR[e.kind] || "#333",
      "stroke-dasharray": e.kind === "checkpoint" ? "2,3" : "", "stroke-width": e.kind === "checkpoint" ? 1 : 2 }));
    g.appendChild(el("svg:title", {}, e.label));
    svg.appendChild(g);
  }
  svg.appendChild(el("svg:text", { x: 2, y: 14 }, fmt(y1, 2)));
  svg.appendChild(el("svg:text", { x: 2, y: 232 }, fmt(y0, 2)));
  const span = xi === 0 ? `${Math.round(x0).toLocaleString()} - ${Math.round(x1).toLocaleString()} tokens`
    : `${new Date(x0 * 1000).toLocaleTimeString()} - ${new Date(x1 * 1000).toLocaleTimeString()}`;
  svg.appendChild(el("svg:text", { x: 40, y: 252 }, span));
}

function legend(id, colors, used) {
  const box = clear(document.getElementById(id));
  for (const [k, c] of Object.entries(colors)) {
    if (used && !used.has(k)) continue;
    const s = el("span"); s.appendChild(el("i", { style: `background:${c}` })); s.appendChild(document.createTextNode(k));
    box.appendChild(s);
  }
}

function drawIdeas(f) {
  const t = clear(document.getElementById("ideas"));
  const row = (idea, what) => { const r = el("tr", { "data-idea": idea }); r.appendChild(el("th", {}, idea)); r.appendChild(el("td", {}, what)); t.appendChild(r); };
  if (f.skip) row("skip routes", `${f.skip.skipped.toLocaleString()} stage visits skipped (${f.skip.skipped_per_iteration} of ${f.skip.full_visits_per_iteration} per iteration)`);
  if (f.activations) row("activations", `${f.activations.slow_hops} of ${f.activations.hops} hops carry ${f.activations.codec}: ${mib(f.activations.saved_bytes)} saved`);
  row("data parallel", `${mib(f.dp.payload_bytes)} sent; dense fp32 all-reduce ${mib(f.dp.dense_fp32_bytes)}` + (f.dp.ratio ? ` (${f.dp.ratio}x fewer)` : ""));
  row("freezing", `${f.freezing.frozen_layers} layers frozen; ${f.freezing.freezes} freezes, ${f.freezing.undos} undos; activation cache ${f.freezing.cache_hits.toLocaleString()} hits, ${f.freezing.prefills} prefills`);
  row("checkpoints", `${f.checkpoints.committed.length} committed (last: ${f.checkpoints.committed.slice(-3).join(", ") || "-"}); stall ${fmt(f.checkpoints.stall_s, 3)} s`);
}

function drawMembership(events) {
  const t = clear(document.getElementById("membership"));
  const head = el("tr"); for (const h of ["time", "node", "event", "generation", "cause"]) head.appendChild(el("th", {}, h));
  t.appendChild(head);
  for (const e of events) {
    const r = el("tr", { "data-kind": e.kind, "data-node": e.node ?? "" });
    const when = e.time ? new Date(e.time * 1000).toLocaleTimeString() : "-";
    for (const v of [when, e.node ?? "-", e.kind, e.gen ?? "-", e.cause || ""]) r.appendChild(el("td", {}, String(v)));
    t.appendChild(r);
  }
  t.setAttribute("data-rows", events.length);
}

function draw(st) {
  document.body.setAttribute("data-status", st.status);
  document.getElementById("line").textContent = st.line;
  if (st.status === "error") return;
  const last = st.last || {};
  document.getElementById("run").textContent = `${st.run_dir} · iteration ${st.iterations_done}/${st.iterations_total}` +
    ` · generation ${st.generation ?? "-"} · loss ${fmt(last.loss)} · median iteration ${fmt(st.median_iteration_s)} s`;
  drawSwarm(st);
  const nodes = st.nodes.map(n => n.node);
  const m = st.gantt.measured, s = st.gantt.simulated;
  document.getElementById("gantt-measured-title").textContent = `measured, iteration ${m.iteration ?? "-"}`;
  document.getElementById("gantt-simulated-title").textContent = s ? `simulated (as planned): ${fmt(s.iteration_s)} s` : "simulated: not available";
  drawGantt("gantt-measured", m, nodes);
  drawGantt("gantt-simulated", s, nodes);
  legend("gantt-legend", KIND_COLOR);
  drawLoss("loss-tokens", st, 0);
  drawLoss("loss-time", st, 1);
  legend("event-legend", EVENT_COLOR, new Set(st.events.map(e => e.kind)));
  drawIdeas(st.ideas);
  drawMembership(st.membership);
}

async function poll() {
  try {
    const r = await fetch("/state.json", { cache: "no-store" });
    draw(await r.json());
    document.body.setAttribute("data-updates", ++updates);
  } catch (err) {
    document.body.setAttribute("data-status", "unreachable");
    document.getElementById("line").textContent = "the dashboard server does not answer (stopped?): " + err;
  }
  setTimeout(poll, 1000);
}
poll();
