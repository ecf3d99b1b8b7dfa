// Overview: the server's counters with live sparklines, its facts, dataspaces, recorders and errors.
import { h, svg, main, fmtNum, fmtBytes, fmtAge, api, every, table, section, pageHead, errorBox } from "./lib.js";
import { pv } from "./pv.js";

function sparkline(values, w = 160, hgt = 36) {
  const el = svg("svg", { class: "spark", viewBox: `0 0 ${w} ${hgt}`, width: w, height: hgt, "aria-hidden": "true" });
  const pts = values.filter((v) => v != null);
  if (pts.length < 2) return el;
  const max = Math.max(...pts), min = Math.min(0, ...pts);
  const span = max - min || 1;
  const step = w / (values.length - 1);
  const coords = values.map((v, i) => v == null ? null :
    `${(i * step).toFixed(1)},${(hgt - 2 - ((v - min) / span) * (hgt - 4)).toFixed(1)}`).filter(Boolean);
  el.append(svg("polyline", { points: `0,${hgt} ${coords.join(" ")} ${w},${hgt}`, class: "spark-fill" }));
  el.append(svg("polyline", { points: coords.join(" "), class: "spark-line" }));
  return el;
}

const COUNTERS = [
  { key: "connections", label: "connections" },
  { key: "assertions", label: "assertions" },
  { key: "observers", label: "observers" },
  { key: "turns", label: "turns / s", rate: true },
  { key: "messages_in", label: "messages in / s", rate: true },
  { key: "messages_out", label: "messages out / s", rate: true },
  { key: "bytes_in", label: "bytes in / s", rate: true, bytes: true },
  { key: "bytes_out", label: "bytes out / s", rate: true, bytes: true },
  { key: "memory_rss", label: "memory (RSS)", bytes: true },
  { key: "buffered", label: "buffered output", bytes: true },
  { key: "memory_held", label: "held for clients", bytes: true },
  { key: "errors_total", label: "errors (total)" },
  { key: "slow_consumers_closed", label: "slow consumers closed" },
];

export function pageOverview() {
  const m = main();
  const grid = h("div", { class: "counters" });
  const info = h("div");
  m.append(pageHead("Overview", "The server's counters, sampled every second (the last two minutes)."), grid, info);
  const history = new Map(COUNTERS.map((c) => [c.key, []]));
  let prev = null;
  every(1000, async () => {
    let s;
    try { s = await api("/api/server"); } catch (e) { info.replaceChildren(errorBox(e)); return; }
    s.errors_total = Object.values(s.errors || {}).reduce((a, b) => a + b, 0);
    const mb = s.memory_budget;  // the memory budget (--max-memory), if the server has one
    s.memory_held = mb && mb.limit ? mb.used : null;
    for (const c of COUNTERS) {
      let v = s[c.key];
      if (c.rate) v = prev && s[c.key] != null ? Math.max(0, (s[c.key] - prev[c.key]) / Math.max(0.001, s.now - prev.now)) : null;
      const hist = history.get(c.key);
      hist.push(v);
      if (hist.length > 120) hist.shift();
    }
    prev = s;
    grid.replaceChildren(...COUNTERS.map((c) => {
      const hist = history.get(c.key);
      const v = hist[hist.length - 1];
      const shown = v == null ? "–" : c.bytes ? fmtBytes(v) + (c.rate ? "/s" : "") : fmtNum(v);
      return h("div", { class: "counter", dataset: { key: c.key } },
        h("div", { class: "counter-label" }, c.label),
        h("div", { class: "counter-value" }, shown),
        sparkline(hist.length > 1 ? hist : [v, v]));
    }));
    const facts = [
      ["version", s.version], ["server id", s.server_id], ["access", s.scope + (s.http_open ? " (open, no token)" : "")],
      ["uptime", fmtAge(s.uptime)], ["process", s.pid], ["listening on", (s.listeners || []).join(", ")],
      ["data directory", s.data_dir], ["stream store", s.store], ["published streams", (s.published || []).join(", ") || null],
      ["connections accepted / refused", s.connections_accepted + " / " + s.connections_refused],
      ["links", s.links ? `${s.links.connected} of ${s.links.count} connected` : null],
      ["syncs held", s.syncs_held],
      ["memory budget", mb ? (mb.limit ? `${fmtBytes(mb.used)} of ${fmtBytes(mb.limit)} held; ${fmtNum(mb.refused)} assertions refused` : "off") : null],
    ].filter(([, v]) => v != null && v !== "");
    const dsRows = Object.entries(s.dataspaces || {}).map(([name, d]) => ({ name, ...d }));
    const errs = Object.entries(s.errors || {}).map(([kind, n]) => ({ kind, n }));
    info.replaceChildren(h("div", { class: "two" },
      section("Server", h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", null, k), h("dd", null, String(v))]))),
      h("div", null,
        section("Dataspaces", table([
          { key: "name", label: "dataspace", render: (r) => h("a", { href: "/inspector/dataspace?dataspace=" + encodeURIComponent(r.name) }, r.name) },
          { key: "assertions", label: "assertions", num: true },
          { key: "observers", label: "observers", num: true },
        ], dsRows)),
        s.recorders && s.recorders.length ? section("Recorders", table([
          { key: "stream", label: "stream", render: (r) => h("a", { href: "/inspector/streams?stream=" + encodeURIComponent(r.stream) }, r.stream) },
          { key: "pattern", label: "pattern", render: (r) => pv(r.pattern) },
          { key: "recorded", label: "recorded", num: true },
          { key: "dropped", label: "dropped", num: true },
          { key: "queued", label: "queued", num: true },
          { key: "failed", label: "failed", render: (r) => r.failed ? h("span", { class: "bad" }, r.failed) : "no" },
        ], s.recorders)) : null,
        section("Errors by kind", table([{ key: "kind", label: "kind" }, { key: "n", label: "count", num: true }], errs)))));
  });
}
