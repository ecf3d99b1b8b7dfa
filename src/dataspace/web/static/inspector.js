// The dataspace inspector: pages that read the server's JSON endpoints (/api/...).
// Plain JavaScript, no build step, nothing loaded from another host.  Every value from
// the server goes into the page as text (textContent / text nodes), never as HTML:
// Preserves text such as <Present "alice"> would otherwise parse as a tag and vanish.
"use strict";
(() => {
  const TOKEN_COOKIE = "dataspace_token";

  // ---------------------------------------------------------------------------------
  // DOM helpers: strings always become text nodes.

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    setAttrs(el, attrs);
    for (const c of children.flat(Infinity)) {
      if (c == null || c === false) continue;
      el.append(c instanceof Node ? c : String(c));
    }
    return el;
  }

  function svg(tag, attrs, ...children) {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    setAttrs(el, attrs);
    for (const c of children.flat(Infinity)) {
      if (c == null || c === false) continue;
      el.append(c instanceof Node ? c : String(c));
    }
    return el;
  }

  function setAttrs(el, attrs) {
    if (!attrs) return;
    for (const [k, v] of Object.entries(attrs)) {
      if (v == null || v === false) continue;
      if (k === "class") el.setAttribute("class", v);
      else if (k === "dataset") Object.assign(el.dataset, v);
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "value") el.value = v;
      else el.setAttribute(k, v === true ? "" : String(v));
    }
  }

  const $ = (sel, root = document) => root.querySelector(sel);
  const main = () => $("#main");
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  function fmtNum(n) {
    if (n == null) return "–";
    if (typeof n !== "number") return String(n);
    if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(n >= 1e7 ? 0 : 1) + " M";
    if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(n >= 1e5 ? 0 : 1) + " k";
    return Number.isInteger(n) ? String(n) : n.toFixed(n < 10 ? 2 : 1);
  }

  function fmtBytes(n) {
    if (n == null) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n < 10 ? 1 : 0) : String(Math.round(n))) + " " + u[i];
  }

  function fmtAge(s) {
    if (s == null) return "–";
    s = Math.max(0, s);
    if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }

  function fmtTime(t) {
    if (t == null) return "–";
    const d = new Date(t * 1000);
    return d.toLocaleString(undefined, { hour12: false });
  }

  function clock() {
    const d = new Date();
    const p = (n, w = 2) => String(n).padStart(w, "0");
    return `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}.${p(d.getMilliseconds(), 3)}`;
  }

  // ---------------------------------------------------------------------------------
  // Preserves text, coloured: split into tokens, each a <span> holding text.  The
  // concatenated text is always exactly the input; embedded references (#:...) get
  // their own span so they stand out.

  const DELIM = new Set(["<", ">", "[", "]", "{", "}", '"', ",", ";", " ", "\t", "\n", "\r"]);
  const OPEN = { "<": ">", "[": "]", "{": "}" };

  function scanString(t, i, q) { // t[i] is the opening quote: index after the closing one
    for (let j = i + 1; j < t.length; j++) {
      if (t[j] === "\\") j++;
      else if (t[j] === q) return j + 1;
    }
    return t.length;
  }

  function scanValue(t, i) { // the end of one value starting at i
    while (i < t.length && /\s/.test(t[i])) i++;
    if (i >= t.length) return i;
    const c = t[i];
    if (c === '"' || c === "|") return scanString(t, i, c);
    if (OPEN[c]) {
      const stack = [OPEN[c]];
      let j = i + 1;
      while (j < t.length && stack.length) {
        const d = t[j];
        if (d === '"' || d === "|") { j = scanString(t, j, d); continue; }
        if (OPEN[d]) stack.push(OPEN[d]);
        else if (d === stack[stack.length - 1]) stack.pop();
        j++;
      }
      return j;
    }
    if (c === "#" && t[i + 1] === ":") return scanValue(t, i + 2);
    if (c === "#" && (t[i + 1] === '"' || ((t[i + 1] === "x" || t[i + 1] === "[") && t[i + 2] === '"'))) {
      const q = t.indexOf('"', i);
      return scanString(t, q, '"');
    }
    let j = i + 1;
    while (j < t.length && !DELIM.has(t[j])) j++;
    return j;
  }

  function pvInto(parent, t, start, end) {
    let i = start;
    let afterOpen = false;
    while (i < end) {
      const c = t[i];
      let j;
      let cls = null;
      if (/\s/.test(c)) {
        j = i + 1;
        while (j < end && /\s/.test(t[j])) j++;
        parent.append(t.slice(i, j));
        i = j;
        continue;
      }
      if (c === "#" && t[i + 1] === ":") {
        j = Math.min(scanValue(t, i + 2), end);
        const span = h("span", { class: "pv-emb", title: "an embedded reference" }, "#:");
        pvInto(span, t, i + 2, j);
        parent.append(span);
        i = j;
        afterOpen = false;
        continue;
      }
      if (c === '"') { j = scanString(t, i, '"'); cls = "pv-str"; }
      else if (c === "|") { j = scanString(t, i, "|"); cls = afterOpen ? "pv-label" : "pv-sym"; }
      else if (c === "#" && (t[i + 1] === '"' || ((t[i + 1] === "x" || t[i + 1] === "[") && t[i + 2] === '"'))) {
        j = scanString(t, t.indexOf('"', i), '"');
        cls = "pv-bytes";
      } else if (OPEN[c] || c === ">" || c === "]" || c === "}" || c === "," || c === ";") {
        j = i + 1;
        cls = "pv-punct";
      } else {
        j = i + 1;
        while (j < end && !DELIM.has(t[j])) j++;
        const word = t.slice(i, j);
        if (afterOpen) cls = "pv-label";
        else if (/^[-+]?(\d|\.\d)/.test(word)) cls = "pv-num";
        else if (word.startsWith("#")) cls = "pv-kw";
        else if (word === "_" || word.startsWith("$")) cls = "pv-pat";
        else cls = "pv-sym";
      }
      j = Math.min(j, end);
      parent.append(h("span", { class: cls }, t.slice(i, j)));
      afterOpen = c === "<";
      i = j;
    }
  }

  function pv(text, cls = "") {
    const span = h("span", { class: ("pv " + cls).trim() });
    const t = String(text ?? "");
    if (t.length > 20000) span.append(t); // very long values: plain text, no colours
    else pvInto(span, t, 0, t.length);
    return span;
  }

  // ---------------------------------------------------------------------------------
  // The API: JSON over fetch, with the cookie; 401 shows the sign-in box.

  class ApiError extends Error {
    constructor(status, body) {
      super((body && body.error) || `HTTP ${status}`);
      this.status = status;
      this.body = body || {};
    }
  }

  async function readError(r) {
    let body;
    try { body = await r.json(); } catch (e) { body = { error: `HTTP ${r.status} ${r.statusText}` }; }
    if (r.status === 401) showLogin(body.error);
    return new ApiError(r.status, body);
  }

  async function api(path, opts = {}) {
    let r;
    try {
      r = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" }, ...opts });
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(0, { error: "the server does not answer (" + e.message + ")" });
    }
    if (!r.ok) throw await readError(r);
    return r.json();
  }

  function setCookie(token) {
    const enc = encodeURIComponent(token).replace(/[!'()*]/g,
      (c) => "%" + c.charCodeAt(0).toString(16).toUpperCase());
    const secure = location.protocol === "https:" ? "; Secure" : "";
    document.cookie = `${TOKEN_COOKIE}=${enc}; Path=/; SameSite=Strict${secure}`;
  }

  function clearCookie() {
    document.cookie = `${TOKEN_COOKIE}=; Path=/; Max-Age=0; SameSite=Strict`;
  }

  const hasCookie = () => document.cookie.split(";").some((c) => c.trim().startsWith(TOKEN_COOKIE + "="));

  let loginShown = false;
  let currentPage = "";
  function showLogin(message) {
    const box = $("#login");
    if (!box) return;
    box.hidden = false;
    if (!loginShown) {
      loginShown = true;
      stopAll();
      if (currentPage) main().replaceChildren(); // the index keeps its list of pages
      $("#token").focus();
    }
    if (message && hasCookie()) $("#login-error").textContent = message;
  }

  function setupLogin() {
    $("#login-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const token = $("#token").value.trim();
      const err = $("#login-error");
      err.textContent = "";
      if (!token) { err.textContent = "paste a sturdyref first"; return; }
      setCookie(token);
      try {
        const r = await fetch("/api/server", { credentials: "same-origin" });
        if (r.ok) { location.reload(); return; }
        const body = await r.json().catch(() => ({}));
        err.textContent = body.error || `HTTP ${r.status}`;
        clearCookie();
      } catch (e) {
        err.textContent = "the server does not answer: " + e.message;
      }
    });
  }

  function banner(message) {
    const b = $("#banner");
    if (!message) { b.hidden = true; b.textContent = ""; return; }
    b.hidden = false;
    b.textContent = message;
  }

  // A bad pattern: the parser's message, and the pattern with a caret at the position.
  function patternError(err, text) {
    const box = h("div", { class: "pattern-error", role: "alert" },
      h("div", { class: "error-text" }, err.message));
    const b = err.body || {};
    if (b.position != null || b.line != null) {
      const lines = String(text).split("\n");
      const line = b.line != null ? b.line : 1;
      const col = b.column != null ? b.column : (b.position || 0) + 1;
      const src = lines[Math.min(line, lines.length) - 1] || "";
      box.append(h("pre", { class: "caret" },
        h("span", { class: "src" }, src), "\n",
        h("span", { class: "mark" }, " ".repeat(Math.max(0, col - 1)) + "^"),
        ` position ${b.position ?? "?"} (line ${line}, column ${col})`));
    }
    return box;
  }

  // ---------------------------------------------------------------------------------
  // Timers and event streams that stop when the page changes.

  const running = new Set();
  function stopAll() { for (const s of running) s.stop(); running.clear(); }

  // Call fn now and every ms after it finishes (skipped while the tab is hidden).
  function every(ms, fn) {
    let stopped = false;
    let timer = null;
    const loop = async () => {
      if (stopped) return;
      if (!document.hidden) {
        try { await fn(); } catch (e) { if (e.name !== "AbortError") console.warn(e); }
      }
      if (!stopped) timer = setTimeout(loop, ms);
    };
    const handle = { stop() { stopped = true; clearTimeout(timer); running.delete(handle); } };
    running.add(handle);
    loop();
    return handle;
  }

  // GET /api/watch as Server-Sent Events, read with fetch (so an error answer's JSON,
  // e.g. a bad pattern's message and position, reaches the page; EventSource hides it).
  // Reconnects after the stream ends; on: {open, event, synced, error, status}.
  function watch(params, on) {
    const ctl = new AbortController();
    let stopped = false;
    const handle = { stop() { stopped = true; ctl.abort(); running.delete(handle); } };
    running.add(handle);
    const dispatch = (block) => {
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const k = line.indexOf(":");
        const field = k < 0 ? line : line.slice(0, k);
        let v = k < 0 ? "" : line.slice(k + 1);
        if (v.startsWith(" ")) v = v.slice(1);
        if (field === "event") name = v;
        else if (field === "data") data.push(v);
      }
      if (!data.length) return;
      let obj;
      try { obj = JSON.parse(data.join("\n")); } catch (e) { return; }
      if (name === "synced") on.synced(obj);
      else if (name === "error") on.status(obj.error || "the watch ended", true);
      else on.event(obj);
    };
    (async () => {
      let backoff = 500;
      while (!stopped) {
        let r;
        try {
          r = await fetch("/api/watch?" + new URLSearchParams(params), {
            credentials: "same-origin", signal: ctl.signal, headers: { Accept: "text/event-stream" },
          });
        } catch (e) {
          if (stopped) return;
          on.status("the server does not answer; retrying …", true);
          await sleep(backoff);
          backoff = Math.min(backoff * 2, 10000);
          continue;
        }
        if (!r.ok) {
          const err = await readError(r);
          if (r.status === 503 && !stopped) {
            on.status(err.message + "; retrying …", true);
            await sleep(Math.max(1000, (Number(r.headers.get("Retry-After")) || 2) * 1000));
            continue;
          }
          on.error(err);
          handle.stop();
          return;
        }
        backoff = 500;
        on.open();
        const reader = r.body.getReader();
        const dec = new TextDecoder();
        let buf = "";
        try {
          for (;;) {
            const { value, done } = await reader.read();
            if (done) break;
            buf += dec.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
            if (buf.indexOf("\n\n") < 0) continue;
            const blocks = buf.split("\n\n"); // one pass: a chunk may hold thousands
            buf = blocks.pop();
            for (const block of blocks) dispatch(block);
          }
        } catch (e) {
          if (stopped) return;
        }
        if (stopped) return;
        on.status("the event stream ended; reconnecting …", true);
        await sleep(backoff);
      }
    })();
    return handle;
  }

  // ---------------------------------------------------------------------------------
  // Shared pieces of pages

  function table(columns, rows, opts = {}) {
    // columns: [{key, label, render?, num?}]; rows: objects
    const thead = h("thead", null, h("tr", null, columns.map((c) =>
      h("th", { class: c.num ? "num" : null, title: c.title || null }, c.label))));
    const tbody = h("tbody");
    for (const row of rows) {
      tbody.append(h("tr", opts.rowAttrs ? opts.rowAttrs(row) : null, columns.map((c) => {
        const v = c.render ? c.render(row) : row[c.key];
        return h("td", { class: c.num ? "num" : null }, v instanceof Node ? v : (c.num ? fmtNum(v) : (v ?? "–")));
      })));
    }
    if (!rows.length && opts.empty) {
      tbody.append(h("tr", null, h("td", { colspan: columns.length, class: "empty" }, opts.empty)));
    }
    return h("table", { class: "grid " + (opts.class || "") }, thead, tbody);
  }

  function section(title, ...children) {
    return h("section", { class: "card" }, h("h2", null, title), ...children);
  }

  function pageHead(title, sub) {
    return h("div", { class: "page-head" }, h("h1", null, title), sub ? h("p", { class: "lead" }, sub) : null);
  }

  function errorBox(e) {
    return h("div", { class: "error-box", role: "alert" }, e.message || String(e));
  }

  function query() { return new URLSearchParams(location.search); }
  function setQuery(params) {
    const q = new URLSearchParams(params);
    history.replaceState(null, "", location.pathname + "?" + q.toString());
  }

  async function dataspaceNames() {
    try {
      const s = await api("/api/server");
      return Object.keys(s.dataspaces || {}).sort();
    } catch (e) {
      return ["root"];
    }
  }

  // ---------------------------------------------------------------------------------
  // Overview: counters with live sparklines

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
    { key: "errors_total", label: "errors (total)" },
    { key: "slow_consumers_closed", label: "slow consumers closed" },
  ];

  function pageOverview() {
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

  // ---------------------------------------------------------------------------------
  // Connections

  function pageConnections() {
    const m = main();
    const out = h("div");
    m.append(pageHead("Connections", "Every connection to this server, refreshed every two seconds. Click a heading to sort."), out);
    let sortKey = "id", sortDir = 1;
    const cols = [
      { key: "id", label: "id", num: true },
      { key: "peer", label: "peer" },
      { key: "transport", label: "via" },
      { key: "dataspaces", label: "dataspaces", render: (r) => r.dataspaces.map((d) => d.name + (d.attenuated ? " (attenuated)" : "")).join(", ") },
      { key: "age", label: "age", render: (r) => fmtAge(r.age) },
      { key: "assertions_in", label: "asserted", num: true, title: "assertions it holds (observers and its resolve request included)" },
      { key: "observers", label: "observers", num: true },
      { key: "assertions_out", label: "matches", num: true, title: "what its observers are told of now" },
      { key: "messages_in", label: "msgs in", num: true },
      { key: "messages_out", label: "msgs out", num: true },
      { key: "bytes_in", label: "bytes in", num: true, render: (r) => fmtBytes(r.bytes_in) },
      { key: "bytes_out", label: "bytes out", num: true, render: (r) => fmtBytes(r.bytes_out) },
      { key: "pending_output", label: "pending", num: true, render: (r) => fmtBytes(r.pending_output) },
      { key: "idle", label: "idle", render: (r) => fmtAge(r.idle) },
      { key: "held", label: "held", render: (r) => (r.held || []).join(", ") || "" },
    ];
    let last = null;
    const render = () => {
      if (!last) return;
      const rows = [...last.connections].sort((a, b) => {
        const x = a[sortKey], y = b[sortKey];
        return (x < y ? -1 : x > y ? 1 : 0) * sortDir;
      });
      const t = table(cols, rows, { empty: "No connections.", class: "connections" });
      t.querySelectorAll("th").forEach((th, i) => {
        th.classList.add("sortable");
        if (cols[i].key === sortKey) th.classList.add(sortDir > 0 ? "asc" : "desc");
        th.addEventListener("click", () => {
          if (sortKey === cols[i].key) sortDir = -sortDir; else { sortKey = cols[i].key; sortDir = 1; }
          render();
        });
      });
      out.replaceChildren(h("p", { class: "count" }, `${last.count} connection${last.count === 1 ? "" : "s"}`,
        last.note ? h("span", { class: "note" }, " · ", last.note) : null),
        last.note ? "" : h("div", { class: "scroll" }, t)); // a dataspace's token: the count only
    };
    every(2000, async () => {
      try { last = await api("/api/connections"); render(); } catch (e) { out.replaceChildren(errorBox(e)); }
    });
  }

  // ---------------------------------------------------------------------------------
  // A pattern form (dataspace + pattern), shared by the browser and the console

  async function patternForm(defaults, onSubmit, buttonLabel) {
    const names = await dataspaceNames();
    const q = query();
    const dsName = q.get("dataspace") || defaults.dataspace || names[0] || "root";
    const sel = h("select", { id: "dataspace", name: "dataspace", "aria-label": "dataspace" },
      (names.includes(dsName) ? names : [dsName, ...names]).map((n) => h("option", { value: n }, n)));
    sel.value = dsName;
    const input = h("input", {
      id: "pattern", name: "pattern", type: "text", spellcheck: "false", autocomplete: "off",
      value: q.get("pattern") || defaults.pattern, "aria-label": "pattern",
      placeholder: "a pattern, e.g. <Present $who>",
    });
    const form = h("form", { class: "pattern-form" },
      h("label", null, "dataspace ", sel),
      h("label", { class: "grow" }, "pattern ", input),
      h("button", { type: "submit", id: "go" }, buttonLabel));
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      setQuery({ dataspace: sel.value, pattern: input.value });
      onSubmit(sel.value, input.value);
    });
    return { form, sel, input };
  }

  // ---------------------------------------------------------------------------------
  // The dataspace browser: current assertions matching a pattern, live

  async function pageDataspace() {
    const m = main();
    const status = h("span", { id: "status", class: "status" });
    const err = h("div", { id: "pattern-error" });
    const tbody = h("tbody", { id: "assertions" });
    const count = h("span", { id: "count" }, "");
    const subs = h("div");
    let current = null;
    const rows = new Map(); // key -> {tr, n, sort}
    let order = []; // {sort, tr} in the table's order (binary search: 10,000 rows stay quick)
    let synced = false;
    const place = (sort) => {
      let lo = 0, hi = order.length;
      while (lo < hi) { const mid = (lo + hi) >> 1; if (order[mid].sort < sort) lo = mid + 1; else hi = mid; }
      return lo;
    };
    const start = (ds, pattern) => {
      if (current) current.stop();
      err.replaceChildren();
      tbody.replaceChildren();
      rows.clear();
      order = [];
      count.textContent = "";
      status.textContent = "connecting …";
      status.className = "status";
      if (!pattern.trim()) { status.textContent = "type a pattern"; return; }
      const keyOf = (ev) => ev.value ?? ev.match ?? JSON.stringify(ev.captures);
      const update = () => { count.textContent = `${rows.size} matching`; };
      current = watch({ dataspace: ds, pattern }, {
        open() {
          tbody.replaceChildren(); rows.clear(); order = []; synced = false; update();
          status.textContent = "loading …";
        },
        synced() { synced = true; status.textContent = "live"; status.className = "status live"; update(); },
        status(text, bad) { status.textContent = text; status.className = "status" + (bad ? " bad" : ""); },
        error(e) {
          status.textContent = "stopped";
          status.className = "status bad";
          err.replaceChildren(e.status === 400 ? patternError(e, pattern) : errorBox(e));
        },
        event(ev) {
          const key = keyOf(ev);
          if (ev.event === "+") {
            const had = rows.get(key);
            if (had) { had.n++; return; }
            const text = ev.value ?? ev.match ?? "";
            const tr = h("tr", { class: synced ? "fresh" : null },
              h("td", { class: "value" }, pv(text)),
              h("td", { class: "captures" }, ev.captures.map((c, i) => [i ? h("span", { class: "sep" }, " · ") : null, pv(c)])));
            // keep the rows sorted by their text
            const sort = text + "\u0000" + key;
            const at = place(sort);
            tbody.insertBefore(tr, at < order.length ? order[at].tr : null);
            order.splice(at, 0, { sort, tr });
            rows.set(key, { tr, n: 1, sort });
          } else if (ev.event === "-") {
            const had = rows.get(key);
            if (!had) return;
            if (--had.n <= 0) {
              had.tr.remove();
              rows.delete(key);
              const at = place(had.sort);
              if (at < order.length && order[at].sort === had.sort) order.splice(at, 1);
            }
          }
          update();
        },
      });
    };
    const { form } = await patternForm({ pattern: "_" }, start, "Watch");
    m.append(pageHead("Dataspace", "The assertions in a dataspace that match a pattern, kept up to date as they appear and go. " +
      "Patterns: _ anything, $name capture, <Label field ...> records (extra fields ignored), [ ... ] sequences, literals."),
      form, err,
      h("div", { class: "two wide-left" },
        section(h("span", null, "Assertions ", count, " ", status),
          h("div", { class: "scroll" }, h("table", { class: "grid values" },
            h("thead", null, h("tr", null, h("th", null, "assertion"), h("th", null, "captures"))), tbody))),
        section("Observed patterns", h("p", { class: "note" }, "Who is interested in what (click one to browse it)."), subs)));
    start($("#dataspace").value, $("#pattern").value);
    every(3000, async () => {
      try {
        const s = await api("/api/subscriptions?dataspace=" + encodeURIComponent($("#dataspace").value));
        subs.replaceChildren(table([
          { key: "pattern", label: "pattern", render: (r) => h("a", {
            href: "#", class: "pick",
            onclick: (ev) => { ev.preventDefault(); $("#pattern").value = r.pattern; $("#go").click(); },
          }, pv(r.pattern)) },
          { key: "observers", label: "observers", num: true },
          { key: "matches", label: "matches", num: true },
        ], s.patterns, { empty: "Nobody observes anything." }));
      } catch (e) {
        subs.replaceChildren(errorBox(e));
      }
    });
  }

  // ---------------------------------------------------------------------------------
  // The observe console: + / - / ! as they arrive

  async function pageObserve() {
    const m = main();
    const status = h("span", { id: "status", class: "status" });
    const err = h("div", { id: "pattern-error" });
    const log = h("ol", { id: "events", class: "events" });
    const logBox = h("div", { class: "log" }, log);
    let current = null;
    let scrolling = false;
    const line = (kind, ...content) => {
      if (!scrolling) { // once a frame: follow the end if the reader is at the end
        scrolling = true;
        const stick = logBox.scrollTop + logBox.clientHeight >= logBox.scrollHeight - 4;
        requestAnimationFrame(() => { scrolling = false; if (stick) logBox.scrollTop = logBox.scrollHeight; });
      }
      log.append(h("li", { class: "ev ev-" + kind, dataset: { kind } },
        h("span", { class: "t" }, clock()), h("span", { class: "k" }, kind), h("span", { class: "v" }, ...content)));
      if (log.children.length > 2000) log.firstChild.remove();
    };
    const start = (ds, pattern) => {
      if (current) current.stop();
      err.replaceChildren();
      if (!pattern.trim()) { status.textContent = "type a pattern"; return; }
      status.textContent = "connecting …";
      status.className = "status";
      current = watch({ dataspace: ds, pattern }, {
        open() { line("·", `watching ${pattern} in ${ds}`); },
        synced(s) {
          status.textContent = "live";
          status.className = "status live";
          line("·", `synced: ${s.matches} current match${s.matches === 1 ? "" : "es"} above; what follows is live`);
        },
        status(text, bad) { status.textContent = text; status.className = "status" + (bad ? " bad" : ""); },
        error(e) {
          status.textContent = "stopped";
          status.className = "status bad";
          err.replaceChildren(e.status === 400 ? patternError(e, pattern) : errorBox(e));
        },
        event(ev) { line(ev.event, pv(ev.value ?? ev.match)); },
      });
    };
    const { form } = await patternForm({ pattern: "<Says $who $text>" }, start, "Observe");
    form.append(h("button", { type: "button", class: "secondary", onclick: () => { current && current.stop(); status.textContent = "stopped"; status.className = "status"; } }, "Stop"),
      h("button", { type: "button", class: "secondary", onclick: () => log.replaceChildren() }, "Clear"));
    m.append(pageHead("Observe", "Type a pattern and watch: + an assertion appears, - it goes, ! a message. The current matches come first."),
      form, err, h("p", null, "Status: ", status), logBox);
    start($("#dataspace").value, $("#pattern").value);
  }

  // ---------------------------------------------------------------------------------
  // Streams: the list, and one stream's tail with search

  function pageStreams() {
    const m = main();
    const list = h("div");
    const tail = h("div", { id: "tail" });
    m.append(pageHead("Streams", "The durable streams in the server's store, and the tail of one (click its name)."), list, tail);
    let selected = query().get("stream");
    every(2000, async () => {
      let data;
      try { data = await api("/api/streams"); } catch (e) { list.replaceChildren(errorBox(e)); return; }
      list.replaceChildren(section("Streams", table([
        { key: "name", label: "stream", render: (r) => h("a", { href: "?stream=" + encodeURIComponent(r.name), class: r.name === selected ? "sel" : null,
          onclick: (ev) => { ev.preventDefault(); selected = r.name; setQuery({ stream: r.name }); showTail(r.name); } }, r.name) },
        { key: "length", label: "entries", num: true },
        { key: "next", label: "next index", num: true },
        { key: "last_time", label: "last append", render: (r) => fmtTime(r.last_time) },
        { key: "retention", label: "retention", render: (r) => [r.max_count != null ? `${r.max_count} entries` : null, r.max_age != null ? `${r.max_age} s` : null].filter(Boolean).join(", ") || "all" },
        { key: "tailers", label: "readers (lag)", render: (r) => r.tailers.map((t) => `${t.name} (${t.lag})`).join(", ") || "" },
        { key: "published", label: "published", render: (r) => r.published ? "yes" : "" },
      ], data.streams, { empty: "No streams yet: record some with dataspace serve --record STREAM:PATTERN." })));
    });
    let tailTimer = null;
    const showTail = (name) => {
      if (tailTimer) tailTimer.stop();
      const search = h("input", { id: "search", type: "search", placeholder: "search (text contained, any case)", value: query().get("search") || "", "aria-label": "search" });
      const follow = h("input", { id: "follow", type: "checkbox", checked: true });
      const body = h("tbody", { id: "entries" });
      const info = h("span", { class: "note" });
      const more = h("button", { type: "button", class: "secondary", hidden: true }, "Older");
      let next = null, before = null, gen = 0, summary = "";
      const tell = () => { info.textContent = `${body.children.length} shown${summary}`; };
      const row = (e) => h("tr", null, h("td", { class: "num" }, String(e.index)), h("td", { class: "time" }, fmtTime(e.time)),
        h("td", { class: "value" }, pv(e.value), e.meta ? h("div", { class: "meta" }, "meta ", pv(e.meta)) : null));
      const params = (extra) => {
        const p = new URLSearchParams(extra);
        if (search.value) p.set("search", search.value);
        return p.toString();
      };
      const url = (extra) => "/api/stream/" + encodeURIComponent(name) + "?" + params(extra);
      const load = async () => {
        const g = ++gen;
        body.replaceChildren();
        info.textContent = "loading …";
        try {
          const d = await api(url({ limit: 100 }));
          if (g !== gen) return;
          body.append(...d.entries.map(row));
          next = d.next;
          before = d.next_before;
          more.hidden = before == null;
          summary = ` of ${d.next - (d.first ?? d.next)} (indices ${d.first ?? "–"} to ${d.next - 1})` + (d.search ? `, matching “${d.search}”` : "");
          tell();
        } catch (e) {
          info.textContent = "";
          body.replaceChildren(h("tr", null, h("td", { colspan: 3 }, errorBox(e))));
        }
      };
      more.addEventListener("click", async () => {
        if (before == null) return;
        try {
          const d = await api(url({ limit: 100, before }));
          body.prepend(...d.entries.map(row));
          before = d.next_before;
          more.hidden = before == null;
          tell();
        } catch (e) { info.textContent = e.message; }
      });
      let typing = null;
      search.addEventListener("input", () => {
        clearTimeout(typing);
        typing = setTimeout(() => { setQuery({ stream: name, search: search.value }); load(); }, 250);
      });
      tail.replaceChildren(section(h("span", null, "Tail of ", h("code", null, name)),
        h("div", { class: "pattern-form" }, h("label", { class: "grow" }, "search ", search), h("label", null, follow, " follow"), more, info),
        h("div", { class: "scroll tall" }, h("table", { class: "grid entries" },
          h("thead", null, h("tr", null, h("th", { class: "num" }, "index"), h("th", null, "time"), h("th", null, "value"))), body))));
      load();
      tailTimer = every(1000, async () => {
        if (!follow.checked || next == null) return;
        const g = gen;
        const d = await api(url({ from: next, limit: 1000 }));
        if (g !== gen) return;
        next = d.next_from ?? d.next;
        if (!d.entries.length) return;
        body.append(...d.entries.map(row));
        while (body.children.length > 2000) body.firstChild.remove();
        summary = ` (followed up to index ${next - 1})` + (search.value ? `, matching “${search.value}”` : "");
        tell();
      });
    };
    if (selected) showTail(selected);
  }

  // ---------------------------------------------------------------------------------
  // Pipelines: each graph drawn as SVG, lag on the edges

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

  function pagePipelines() {
    const m = main();
    const out = h("div", { id: "graphs" });
    m.append(pageHead("Pipelines", "Every processor graph that has run on the server's store: streams (rounded) feed processors (square); the lag on an edge is how many entries of that input the processor has not taken yet. Refreshed every second."), out);
    every(1000, async () => {
      let data;
      try { data = await api("/api/pipelines"); } catch (e) { out.replaceChildren(errorBox(e)); return; }
      if (!data.graphs.length) {
        out.replaceChildren(h("p", { class: "empty" }, "No pipeline has run on this store yet (docs/pipelines.md)."));
        return;
      }
      out.replaceChildren(...data.graphs.map((g, i) => h("section", { class: "card graph-card", dataset: { graph: g.graph } },
        h("h2", null, g.graph, " ", h("span", { class: "lag-total " + (g.lag ? "pos" : "zero") }, `total lag ${g.lag}`),
          g.running ? h("span", { class: "note" }, ` · running: ${g.running}`) : null),
        h("div", { class: "scroll" }, drawGraph(g, i)),
        table([
          { key: "name", label: "processor" },
          { key: "inputs", label: "inputs (position / next, lag)", render: (p) => p.inputs.map((r) => `${r.stream} ${r.position ?? "?"} / ${r.next ?? "?"} (lag ${r.lag ?? "?"})`).join("; ") },
          { key: "outputs", label: "outputs", render: (p) => [...p.outputs, ...p.error_streams.map((s) => s + " (errors)")].join(", ") },
          { key: "steps", label: "backing records", num: true, title: "records of its exactly-once state (snapshots, attempts) kept in its backing stream" },
          { key: "last_step", label: "last step", render: (p) => p.last_step ? `${p.last_step.kind} at ${fmtTime(p.last_step.time)}` : "–" },
          { key: "lag", label: "lag", num: true },
        ], g.processors))));
    });
  }

  // ---------------------------------------------------------------------------------
  // Links

  const LINK_MAIN = ["link", "direction", "dataspace", "connected", "since", "peer_id", "last_error"];

  function pageLinks() {
    const m = main();
    const out = h("div");
    m.append(pageHead("Links", "The links of this server to other brokers: what each upstreams and forwards. Refreshed every two seconds."), out);
    every(2000, async () => {
      let data;
      try { data = await api("/api/links"); } catch (e) { out.replaceChildren(errorBox(e)); return; }
      if (!data.links.length) {
        out.replaceChildren(h("p", { class: "empty" }, "No links. Link brokers with dataspace serve --link ADDRESS --link-cap CAP (docs/links.md)."));
        return;
      }
      out.replaceChildren(...data.links.map((l) => section(
        h("span", null, `${l.direction === "in" ? "from" : "to"} ${l.link} `,
          h("span", { class: "badge " + (l.connected ? "ok" : "bad") }, l.connected ? "connected" : "down")),
        h("dl", { class: "facts" },
          [["dataspace", l.dataspace], ["direction", l.direction], ["since", fmtTime(l.since)], ["peer", l.peer_id], ["last error", l.last_error]]
            .filter(([, v]) => v != null).map(([k, v]) => [h("dt", null, k), h("dd", null, String(v))]),
          Object.entries(l).filter(([k]) => !LINK_MAIN.includes(k)).map(([k, v]) =>
            [h("dt", null, k.replaceAll("_", " ")), h("dd", null, typeof v === "object" && v !== null ? JSON.stringify(v) : String(v))])))));
    });
  }

  // ---------------------------------------------------------------------------------
  // The index page: the list of pages is static HTML; add the server's health.

  function pageIndex() {
    const p = h("p", { class: "health" }, "checking the server …");
    main().insertBefore(p, main().querySelector(".pages"));
    every(5000, async () => {
      try {
        const r = await fetch("/healthz");
        const d = await r.json();
        p.replaceChildren(h("span", { class: "badge " + (r.ok ? "ok" : "bad") }, d.status), " ",
          r.ok ? "the server is serving" : (d.reasons || []).join("; "));
      } catch (e) {
        p.replaceChildren(h("span", { class: "badge bad" }, "no answer"), " the server does not answer");
      }
    });
  }

  const PAGES = {
    overview: pageOverview, connections: pageConnections, dataspace: pageDataspace, observe: pageObserve,
    streams: pageStreams, pipelines: pagePipelines, links: pageLinks,
  };

  async function whoAmI() {
    const who = $("#who");
    try {
      const s = await api("/api/server");
      who.replaceChildren(h("span", { class: "badge" }, s.http_open ? "open: no token" : s.scope));
      if (hasCookie() && !s.http_open) {
        who.append(" ", h("a", { href: "#", id: "signout", onclick: (ev) => { ev.preventDefault(); clearCookie(); location.reload(); } }, "sign out"));
      }
      return true;
    } catch (e) {
      if (e.status !== 401) banner(e.message);
      return e.status !== 401;
    }
  }

  async function boot() {
    setupLogin();
    const m = location.pathname.match(/^\/inspector\/([a-z]+)\/?$/);
    const page = m ? m[1] : "";
    currentPage = page;
    for (const a of document.querySelectorAll("#nav a")) if (a.dataset.page === page) a.classList.add("current");
    const ok = await whoAmI();
    if (!ok) return; // the sign-in box is shown
    if (!page) { pageIndex(); return; }
    const fn = PAGES[page];
    if (!fn) { main().replaceChildren(errorBox(new Error(`no page ${page}`))); return; }
    document.title = `${page} · dataspace inspector`;
    main().replaceChildren();
    try { await fn(); } catch (e) { main().append(errorBox(e)); }
  }

  document.addEventListener("DOMContentLoaded", boot);
})();
