// The dataspace browser: the current assertions matching a pattern, live.
import { h, $, main, api, patternError, every, watch, table, section, pageHead, errorBox, patternForm, fmtNum, plural } from "./lib.js";
import { pv } from "./pv.js";

export async function pageDataspace() {
  const m = main();
  const status = h("span", { id: "status", class: "status" });
  const err = h("div", { id: "pattern-error" });
  const tbody = h("tbody", { id: "assertions" });
  const count = h("span", { id: "count" }, "");
  const subs = h("div");
  const groups = h("div", { id: "groups" });
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
    let presence = false; // the observed pattern captures nothing: told only whether it matches
    const update = () => {
      count.textContent = !presence ? `${rows.size} matching`
        : (rows.size ? "something matches" : "nothing matches") +
          " (this token's caveats let it learn only whether something matches, not what)";
    };
    current = watch({ dataspace: ds, pattern }, {
      open() {
        tbody.replaceChildren(); rows.clear(); order = []; synced = false; presence = false; update();
        status.textContent = "loading …";
      },
      synced(s) {
        synced = true; presence = !!s.presence_only;
        status.textContent = "live"; status.className = "status live"; update();
      },
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
      h("div", null,
        section("Observed patterns", h("p", { class: "note" }, "Who is interested in what (click one to browse it)."), subs),
        section("Groups sharing work", h("p", { class: "note" },
          "Observers that joined a group (observe --group): each message goes to one member, each assertion is a job held by one member."), groups))));
  start($("#dataspace").value, $("#pattern").value);
  every(3000, async () => {
    try {
      const s = await api("/api/subscriptions?dataspace=" + encodeURIComponent($("#dataspace").value));
      // The server's own observers (a recorder, the watch of this very page) come last,
      // marked as the server's: real subscriptions, but nobody outside asked for them.
      subs.replaceChildren(table([
        { key: "pattern", label: "pattern", render: (r) => [h("a", {
          href: "#", class: "pick",
          onclick: (ev) => { ev.preventDefault(); $("#pattern").value = r.pattern; $("#go").click(); },
        }, pv(r.pattern)), r.own ? [" ", h("span", { class: "badge idle own", title: "the server's own observer, not a client's" }, "server: " + r.own)] : null] },
        { key: "observers", label: "observers", num: true },
        { key: "matches", label: "matches", num: true },
      ], s.patterns, { empty: "Nobody observes anything.", rowAttrs: (r) => ({ class: r.own ? "own" : "client" }) }));
    } catch (e) {
      subs.replaceChildren(errorBox(e));
    }
    try {
      const g = await api("/api/groups?dataspace=" + encodeURIComponent($("#dataspace").value));
      groups.replaceChildren(groupsTable(g.groups));
    } catch (e) {
      groups.replaceChildren(e.status === 403 ? h("p", { class: "note" }, "This token may not see the groups.") : errorBox(e));
    }
  });
}

// Each group: its name and pattern (click to browse it), then its members in the order
// they joined -- who (the client's name and connection), messages given, jobs held.
function groupsTable(rows) {
  const member = (m) => h("li", { class: "member" + (m.alive ? "" : " gone") },
    h("span", { class: "who" }, m.connection == null ? (m.client || "in process") : `${m.client ?? "connection"} #${m.connection}`),
    `: ${plural(m.messages, "message", "messages")}, ${plural(m.jobs, "job", "jobs")}`);
  return table([
    { key: "group", label: "group", render: (r) => [h("strong", null, r.group), " ", h("a", {
      href: "#", class: "pick",
      onclick: (ev) => { ev.preventDefault(); $("#pattern").value = r.pattern; $("#go").click(); },
    }, pv(r.pattern)), h("ul", { class: "members" }, r.members.map(member))] },
    { key: "member_count", label: "members", num: true },
    { key: "messages", label: "messages", num: true, title: "messages given to a member" },
    { key: "jobs", label: "jobs", num: true, render: (r) => r.pending ? `${fmtNum(r.jobs)} (${fmtNum(r.pending)} waiting)` : fmtNum(r.jobs) },
    { key: "reassigned", label: "moved", num: true, title: "jobs moved to another member (one left or died, or a rebalance)" },
  ], rows, { empty: "No group: nobody shares work here.", rowAttrs: () => ({ class: "group" }) });
}
