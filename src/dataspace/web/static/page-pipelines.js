// Pipelines: each processor graph drawn as SVG, lag on the edges.
import { h, svg, main, fmtAge, fmtTime, api, every, table, pageHead, errorBox } from "./lib.js";

const NODE_W = 150, NODE_H = 44, COL_GAP = 90, ROW_GAP = 22, PAD = 16;

function layout(graph) {
  const nodes = new Map();
  for (const s of graph.streams) nodes.set(s.name, { id: s.name, kind: "stream", data: s });
  for (const p of graph.processors) nodes.set(p.name, { id: p.name, kind: "processor", data: p });
  for (const e of graph.edges) {
    for (const id of [e.from, e.to]) if (!nodes.has(id)) nodes.set(id, { id, kind: "stream", data: { name: id, role: "unknown" } });
  }
  const preds = new Map([...nodes.keys()].map((k) => [k, []]));
  for (const e of graph.edges) preds.get(e.to).push(e.from);
  const layer = new Map([...nodes.keys()].map((k) => [k, 0]));
  for (let round = 0; round < nodes.size; round++) { // longest path; bounded for cycles
    let changed = false;
    for (const [k, ps] of preds) {
      const l = Math.max(0, ...ps.map((p) => layer.get(p) + 1));
      if (l > layer.get(k) && l < nodes.size) { layer.set(k, l); changed = true; }
    }
    if (!changed) break;
  }
  const cols = [];
  for (const [k, l] of layer) (cols[l] = cols[l] || []).push(k);
  const pos = new Map();
  cols.forEach((col, ci) => {
    col = col || [];
    // order by the mean row of the predecessors, then by name
    const key = (k) => {
      const ps = preds.get(k).filter((p) => pos.has(p));
      return ps.length ? ps.reduce((a, p) => a + pos.get(p).row, 0) / ps.length : 0;
    };
    col.sort((a, b) => key(a) - key(b) || (a < b ? -1 : 1));
    col.forEach((k, ri) => pos.set(k, { col: ci, row: ri, x: PAD + ci * (NODE_W + COL_GAP), y: PAD + ri * (NODE_H + ROW_GAP) }));
  });
  const rowsMax = Math.max(1, ...cols.map((c) => (c || []).length));
  return { nodes, pos, width: PAD * 2 + cols.length * NODE_W + (cols.length - 1) * COL_GAP, height: PAD * 2 + rowsMax * NODE_H + (rowsMax - 1) * ROW_GAP };
}

function drawGraph(graph, idx) {
  const { nodes, pos, width, height } = layout(graph);
  const marker = `arrow-${idx}`;
  const root = svg("svg", { class: "graph", viewBox: `0 0 ${width} ${height}`, width, height, role: "img", "aria-label": `graph ${graph.graph}` },
    svg("defs", null, svg("marker", { id: marker, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 9, markerHeight: 9, markerUnits: "userSpaceOnUse", orient: "auto-start-reverse" },
      svg("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrow" }))));
  for (const e of graph.edges) {
    const a = pos.get(e.from), b = pos.get(e.to);
    if (!a || !b) continue;
    const x1 = a.x + NODE_W, y1 = a.y + NODE_H / 2, x2 = b.x - 2, y2 = b.y + NODE_H / 2;
    const mx = (x1 + x2) / 2;
    const g = svg("g", { class: "edge" + (e.lag ? " behind" : ""), "data-from": e.from, "data-to": e.to },
      svg("path", { d: `M ${x1} ${y1} C ${mx} ${y1}, ${mx} ${y2}, ${x2} ${y2}`, "marker-end": `url(#${marker})` }));
    if (e.lag != null) {
      const label = `lag ${e.lag}`;
      const w = 12 + label.length * 7;
      const ly = (y1 + y2) / 2;
      g.append(svg("rect", { x: mx - w / 2, y: ly - 10, width: w, height: 20, rx: 10, class: "edge-label-bg" }),
        svg("text", { x: mx, y: ly + 4, "text-anchor": "middle", class: "edge-lag" + (e.lag ? " pos" : " zero") }, label));
    }
    root.append(g);
  }
  for (const [id, n] of nodes) {
    const p = pos.get(id);
    const d = n.data;
    const sub = n.kind === "processor"
      ? `processor · lag ${d.lag}`
      : (d.length != null ? `${d.length} entr${d.length === 1 ? "y" : "ies"} · ${d.role}` : d.role);
    const name = id.length > 20 ? id.slice(0, 19) + "…" : id;
    root.append(svg("g", { class: `node ${n.kind} role-${d.role || "processor"}`, "data-name": id, transform: `translate(${p.x},${p.y})` },
      svg("title", null, `${n.kind} ${id}`),
      svg("rect", { width: NODE_W, height: NODE_H, rx: n.kind === "stream" ? NODE_H / 2 : 6 }),
      svg("text", { x: NODE_W / 2, y: 18, "text-anchor": "middle", class: "name" }, name),
      svg("text", { x: NODE_W / 2, y: 34, "text-anchor": "middle", class: "sub" }, sub)));
  }
  return root;
}

const STALLED_AFTER = 60; // seconds without a step, behind, while running: say so

// Whether a graph runs, in words: an engine holds its lock (and steps), or nothing
// moves until one is started.
function runState(g, now) {
  const ago = g.last_progress != null ? Math.max(0, now - g.last_progress) : null;
  const last = ago != null ? `last step ${fmtAge(ago)} ago (${fmtTime(g.last_progress)})` : "no step recorded";
  if (!g.running) {
    return { cls: g.lag ? "bad" : "idle", label: "not running", // nothing waits: no alarm
      note: `No engine runs this graph: ${g.lag ? `${g.lag} waiting entr${g.lag === 1 ? "y does" : "ies do"} not move` : "new entries will wait"} until one is started (dataspace pipeline run, docs/pipelines.md); ${last}.` };
  }
  if (g.lag && ago != null && ago > STALLED_AFTER) {
    return { cls: "warn", label: "stalled", note: `Running (${g.running}) but behind with no progress: ${last}.` };
  }
  return { cls: "ok", label: "running", note: `Running: ${g.running}; ${last}.` };
}

export function pagePipelines() {
  const m = main();
  const out = h("div", { id: "graphs" });
  m.append(pageHead("Pipelines", "Every processor graph that has run on the server's store, and whether an engine runs it now: streams (rounded) feed processors (square); the lag on an edge is how many entries of that input the processor has not taken yet. Refreshed every second."), out);
  every(1000, async () => {
    let data;
    try { data = await api("/api/pipelines"); } catch (e) { out.replaceChildren(errorBox(e)); return; }
    if (!data.graphs.length) {
      out.replaceChildren(h("p", { class: "empty" }, "No pipeline has run on this store yet (docs/pipelines.md)."));
      return;
    }
    out.replaceChildren(...data.graphs.map((g, i) => {
      const st = runState(g, data.time);
      return h("section", { class: "card graph-card", dataset: { graph: g.graph, state: st.label } },
        h("h2", null, g.graph, " ", h("span", { class: "badge run-state " + st.cls }, st.label), " ",
          h("span", { class: "lag-total " + (g.lag ? "pos" : "zero") }, `total lag ${g.lag}`)),
        h("p", { class: "run-note " + (st.cls === "ok" || st.cls === "idle" ? "note" : st.cls) }, st.note),
        // A damaged stream of this graph (its bookkeeping, or a processor's backing
        // entries): named with what is wrong; the rest of the graph is still shown.
        (g.damaged || []).length ? h("p", { class: "run-note bad damaged" },
          "Damaged: " + g.damaged.map((d) => `${d.stream} (${d.reason})`).join("; ") +
          " -- `dataspace stream info STREAM --check` says more; restore the store from a backup.") : null,
        h("div", { class: "scroll" }, drawGraph(g, i)),
        table([
          { key: "name", label: "processor" },
          { key: "inputs", label: "inputs (position / next, lag)", render: (p) => p.inputs.map((r) => `${r.stream} ${r.position ?? "?"} / ${r.next ?? "?"} (lag ${r.lag ?? "?"})`).join("; ") },
          { key: "outputs", label: "outputs", render: (p) => [...p.outputs, ...p.error_streams.map((s) => s + " (errors)")].join(", ") },
          { key: "steps", label: "backing records", num: true, title: "records of its exactly-once state (snapshots, attempts) kept in its backing stream" },
          { key: "last_step", label: "last step", render: (p) => p.last_step ? `${p.last_step.kind} at ${fmtTime(p.last_step.time)}` : "–" },
          { key: "lag", label: "lag", num: true },
        ], g.processors));
    }));
  });
}
