// Connections: every connection to the server, sortable.
import { h, main, fmtBytes, fmtAge, api, every, table, pageHead, errorBox } from "./lib.js";

export function pageConnections() {
  const m = main();
  const out = h("div");
  m.append(pageHead("Connections", "Every connection to this server, refreshed every two seconds. Click a heading to sort."), out);
  let sortKey = "id", sortDir = 1;
  const cols = [
    { key: "id", label: "id", num: true },
    { key: "peer", label: "client", title: "the name the client gave, and its address",
      render: (r) => r.name ? h("span", null, h("b", null, r.name), " ", h("span", { class: "meta" }, r.peer)) : r.peer },
    { key: "transport", label: "via" },
    { key: "dataspaces", label: "dataspaces", render: (r) => r.dataspaces.map((d) => d.name + (d.attenuated ? " (attenuated)" : "")).join(", ") },
    { key: "age", label: "age", render: (r) => fmtAge(r.age) },
    { key: "assertions_in", label: "asserted", num: true, title: "what it asserts now, its observers included (not its gatekeeper resolve request: the protocol's, not the client's)" },
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
      last.note ? "" : t); // a dataspace's token: the count only
  };
  every(2000, async () => {
    try { last = await api("/api/connections"); render(); } catch (e) { out.replaceChildren(errorBox(e)); }
  });
}
