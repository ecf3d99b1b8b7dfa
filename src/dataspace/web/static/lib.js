// The inspector's shared parts: DOM helpers, formats, the API (JSON over fetch, sign-in on
// 401), timers and event streams that stop with the page, tables and pattern forms.
// Every value from the server goes into the page as text (textContent / text nodes),
// never as HTML: Preserves text such as <Present "alice"> would otherwise parse as a tag.

const TOKEN_COOKIE = "dataspace_token";

// ---------------------------------------------------------------------------------
// DOM helpers: strings always become text nodes.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  for (const c of children.flat(Infinity)) {
    if (c == null || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

export function svg(tag, attrs, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  setAttrs(el, attrs);
  for (const c of children.flat(Infinity)) {
    if (c == null || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

export function setAttrs(el, attrs) {
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

export const $ = (sel, root = document) => root.querySelector(sel);
export const main = () => $("#main");
export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export function fmtNum(n) {
  if (n == null) return "–";
  if (typeof n !== "number") return String(n);
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(n >= 1e7 ? 0 : 1) + " M";
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(n >= 1e5 ? 0 : 1) + " k";
  return Number.isInteger(n) ? String(n) : n.toFixed(n < 10 ? 2 : 1);
}

// "1 route", "2 routes": a count and the word that agrees with it.
export const plural = (n, one, many) => `${fmtNum(n)} ${n === 1 ? one : many}`;

export function fmtBytes(n) {
  if (n == null) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(n < 10 ? 1 : 0) : String(Math.round(n))) + " " + u[i];
}

export function fmtAge(s) {
  if (s == null) return "–";
  s = Math.max(0, s);
  if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

export function fmtTime(t) {
  if (t == null) return "–";
  const d = new Date(t * 1000);
  return d.toLocaleString(undefined, { hour12: false });
}

export function clock() {
  const d = new Date();
  const p = (n, w = 2) => String(n).padStart(w, "0");
  return `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}.${p(d.getMilliseconds(), 3)}`;
}
// ---------------------------------------------------------------------------------
// The API: JSON over fetch, with the cookie; 401 shows the sign-in box.

export class ApiError extends Error {
  constructor(status, body) {
    super((body && body.error) || `HTTP ${status}`);
    this.status = status;
    this.body = body || {};
  }
}

export async function readError(r) {
  let body;
  try { body = await r.json(); } catch (e) { body = { error: `HTTP ${r.status} ${r.statusText}` }; }
  if (r.status === 401) showLogin(body.error);
  return new ApiError(r.status, body);
}

export async function api(path, opts = {}) {
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

export function setCookie(token) {
  const enc = encodeURIComponent(token).replace(/[!'()*]/g,
    (c) => "%" + c.charCodeAt(0).toString(16).toUpperCase());
  const secure = location.protocol === "https:" ? "; Secure" : "";
  document.cookie = `${TOKEN_COOKIE}=${enc}; Path=/; SameSite=Strict${secure}`;
}

export function clearCookie() {
  document.cookie = `${TOKEN_COOKIE}=; Path=/; Max-Age=0; SameSite=Strict`;
}

export const hasCookie = () => document.cookie.split(";").some((c) => c.trim().startsWith(TOKEN_COOKIE + "="));

let loginShown = false;
let currentPage = "";
/** The page being shown ("" on the index), set once by the boot. */
export function setCurrentPage(page) { currentPage = page; }

export function showLogin(message) {
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

export function setupLogin() {
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

export function banner(message) {
  const b = $("#banner");
  if (!message) { b.hidden = true; b.textContent = ""; return; }
  b.hidden = false;
  b.textContent = message;
}

// A bad pattern: the parser's message, and the pattern with a caret at the position.
export function patternError(err, text) {
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
export function stopAll() { for (const s of running) s.stop(); running.clear(); }

// Call fn now and every ms after it finishes (skipped while the tab is hidden).
export function every(ms, fn) {
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
export function watch(params, on) {
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

export function table(columns, rows, opts = {}) {
  // columns: [{key, label, render?, num?, title?}]; rows: objects.  The table comes in a
  // wrapper that scrolls sideways when it is wider than the screen (a phone), so the
  // page itself never does; each cell says its column (data-col).
  const thead = h("thead", null, h("tr", null, columns.map((c) =>
    h("th", { class: c.num ? "num" : null, title: c.title || null }, c.label))));
  const tbody = h("tbody");
  for (const row of rows) {
    tbody.append(h("tr", opts.rowAttrs ? opts.rowAttrs(row) : null, columns.map((c) => {
      const v = c.render ? c.render(row) : row[c.key];
      const shown = v instanceof Node || Array.isArray(v) ? v : (c.num ? fmtNum(v) : (v ?? "–"));
      return h("td", { class: c.num ? "num" : null, dataset: { col: c.key } }, shown);
    })));
  }
  if (!rows.length && opts.empty) {
    tbody.append(h("tr", null, h("td", { colspan: columns.length, class: "empty" }, opts.empty)));
  }
  return h("div", { class: "table-wrap" }, h("table", { class: "grid " + (opts.class || "") }, thead, tbody));
}

export function section(title, ...children) {
  return h("section", { class: "card" }, h("h2", null, title), ...children);
}

export function pageHead(title, sub) {
  return h("div", { class: "page-head" }, h("h1", null, title), sub ? h("p", { class: "lead" }, sub) : null);
}

export function errorBox(e) {
  return h("div", { class: "error-box", role: "alert" }, e.message || String(e));
}

export function query() { return new URLSearchParams(location.search); }
export function setQuery(params) {
  const q = new URLSearchParams(params);
  history.replaceState(null, "", location.pathname + "?" + q.toString());
}

export async function dataspaceNames() {
  try {
    const s = await api("/api/server");
    return Object.keys(s.dataspaces || {}).sort();
  } catch (e) {
    return ["root"];
  }
}

// ---------------------------------------------------------------------------------
// A pattern form (dataspace + pattern), shared by the browser and the console

export async function patternForm(defaults, onSubmit, buttonLabel) {
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
