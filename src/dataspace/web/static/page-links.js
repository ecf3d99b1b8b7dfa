// Links: the links of this server to other brokers, one row each, and every counter.
import { h, main, fmtAge, fmtBytes, fmtNum, fmtTime, plural, api, every, table, section, pageHead, errorBox } from "./lib.js";

// up, down or refused (the peer answered and said no: a capability it rejects), and why.
export function linkState(l) {
  if (l.connected) return { state: "up", reason: null };
  const refused = l.refused;
  const why = (typeof refused === "string" ? refused : null) ?? l.refused_reason ?? l.reason ?? l.last_error ?? null;
  return { state: refused ? "refused" : "down", reason: why };
}

// Every field of a row, formatted: counts as numbers, bytes as bytes, times as times.
function facts(l, now) {
  const out = [];
  for (const [k, v] of Object.entries(l)) {
    if (v == null || k === "link") continue;
    let shown;
    if (k.startsWith("bytes")) shown = fmtBytes(v);
    else if (k === "since") shown = `${fmtTime(v)} (${fmtAge(now - v)} ago)`;
    else if (typeof v === "boolean") shown = v ? "yes" : "no";
    else if (typeof v === "number") shown = fmtNum(v);
    else if (typeof v === "object") shown = JSON.stringify(v);
    else shown = String(v);
    out.push(h("dt", null, k.replaceAll("_", " ")), h("dd", null, shown));
  }
  return h("dl", { class: "facts" }, out);
}

// The cluster this server is a member of (docs/cluster.md): its members, and its routes
// in the same table as the links (a route is a link between members, one hop).
function clusterCard(c, now) {
  const routes = c.routes.map((r) => ({ ...r, link: r.member_address || r.address }));
  const down = c.members.filter((x) => !x.up);
  return h("section", { class: "card cluster", dataset: { cluster: c.cluster } },
    h("p", { class: "count" }, `cluster ${c.cluster}: member ${c.id} at ${c.address}; ` +
      `${c.size} of ${c.members.length + 1} members up, ${plural(routes.filter((r) => r.connected).length, "route", "routes")} up`),
    c.recording ? h("p", { class: "recording" }, c.recording.summary +
      c.recording.streams.map((s) => `; ${s.stream} led by ` +
        (s.leader ? "this member" : s.led_by ? `member ${s.led_by}` : "no member yet")).join("")) : null,
    routes.length ? linkTable(routes, now, "routes") : null,
    down.length ? h("ul", { class: "members-down" }, down.map((x) => h("li", null,
      `member ${x.id ?? "(not reached yet)"} at ${x.address}: down` +
      (x.attempts != null ? ` (${plural(x.attempts, "attempt", "attempts")}${x.last_error ? ", " + x.last_error : ""})` : "")))) : null);
}

function linkTable(rows, now, cls) {
  return table([
        { key: "link", label: cls === "routes" ? "route" : "link", render: (l) => [
          h("span", { class: "dir", title: l.direction === "in" ? "the peer dialed this server" : "this server dials the peer" },
            l.direction === "in" ? "← from " : "→ to "),
          h("code", null, l.link.replace(/^from /, "")), h("div", { class: "meta" }, l.route ? "cluster route" : `dataspace ${l.dataspace}`)] },
        { key: "state", label: "state", render: (l) => {
          const s = linkState(l);
          return [h("span", { class: "badge link-state " + (s.state === "up" ? "ok" : "bad") }, s.state),
            s.reason ? h("div", { class: "reason" }, s.reason) : null,
            !l.connected && l.attempts != null ? h("div", { class: "meta" }, plural(l.attempts, "attempt", "attempts")) : null];
        } },
        { key: "since", label: "up for", render: (l) => l.connected && l.since != null
          ? h("span", { title: "since " + fmtTime(l.since) }, fmtAge(now - l.since)) : "–" },
        { key: "peer_id", label: "peer", render: (l) => l.peer_id ? h("code", null, l.peer_id) : "–" },
        { key: "subscriptions", label: "subscriptions", title: "what this server asked the peer for (upstreamed of the prefixes its observers want), and what the peer asked for",
          render: (l) => l.connected ? [
            `${fmtNum(l.upstreamed ?? 0)} of ${fmtNum(l.canonical ?? 0)} upstreamed`,
            h("div", { class: "meta" }, `peer wants ${l.peer_everything ? "everything" : fmtNum(l.peer_wants ?? 0)}` +
              ((l.pending ?? 0) ? ` · ${fmtNum(l.pending)} pending` : ""))] : "–" },
        { key: "messages_forwarded", label: "msgs forwarded", num: true },
        { key: "messages_suppressed", label: "suppressed", num: true, title: "messages the peer did not want, not sent" },
        { key: "messages_received", label: "received", num: true },
        { key: "bytes_out", label: "bytes out", num: true, render: (l) => l.bytes_out == null ? "–" : fmtBytes(l.bytes_out) },
        { key: "bytes_in", label: "bytes in", num: true, render: (l) => l.bytes_in == null ? "–" : fmtBytes(l.bytes_in) },
      ], rows, { class: cls, rowAttrs: (l) => ({ dataset: { link: l.link, state: linkState(l).state } }) });
}

export function pageLinks() {
  const m = main();
  const out = h("div");
  m.append(pageHead("Links", "The links of this server to other brokers, and the routes to the other members of its cluster: whether each is up, since when, what it upstreams and what it forwards. Refreshed every two seconds."), out);
  every(2000, async () => {
    let data, cluster;
    try {
      [data, cluster] = await Promise.all([api("/api/links"), api("/api/cluster").catch(() => null)]);
    } catch (e) { out.replaceChildren(errorBox(e)); return; }
    const now = data.time ?? Date.now() / 1000;
    const card = cluster && cluster.cluster ? clusterCard(cluster, now) : null;
    if (!data.links.length) {
      out.replaceChildren(...[card, h("p", { class: "empty" }, "No links. Link brokers with dataspace serve --link ADDRESS --link-cap CAP (docs/links.md)" +
        (card ? "." : "; make a cluster with dataspace serve --cluster HOST:PORT --routes ... (docs/cluster.md)."))].filter(Boolean));
      return;
    }
    const up = data.links.filter((l) => l.connected).length;
    const open = new Set([...out.querySelectorAll("details[open]")].map((d) => d.dataset.link));
    out.replaceChildren(...[card, h("section", { class: "card" },
      h("p", { class: "count" }, `${data.links.length} link${data.links.length === 1 ? "" : "s"}, ${up} up`),
      linkTable(data.links, now, "links")),
      section("Every counter", ...data.links.map((l) => {
        const d = h("details", { dataset: { link: l.link }, open: open.has(l.link) },
          h("summary", null, `${l.direction === "in" ? "from" : "to"} ${l.link.replace(/^from /, "")}`), facts(l, now));
        return d;
      }))].filter(Boolean));
  });
}
