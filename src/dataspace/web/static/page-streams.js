// Streams: the list, and one stream's tail with search.
import { h, main, fmtTime, fmtAge, api, every, table, section, pageHead, errorBox, query, setQuery } from "./lib.js";
import { pv } from "./pv.js";

export function pageStreams() {
  const m = main();
  const list = h("div");
  const groups = h("div", { id: "groups" });
  const tail = h("div", { id: "tail" });
  m.append(pageHead("Streams", "The durable streams in the server's store, and the tail of one (click its name)."), list, groups, tail);
  let selected = query().get("stream");
  every(2000, async () => {
    let data;
    try { data = await api("/api/streams"); } catch (e) { list.replaceChildren(errorBox(e)); return; }
    // A stream whose bookkeeping is damaged is listed with the others, marked, its reason
    // said under the table (the server cannot tell its figures).
    const broken = data.streams.filter((r) => r.damaged != null);
    list.replaceChildren(section("Streams", table([
      { key: "name", label: "stream", render: (r) => [h("a", { href: "?stream=" + encodeURIComponent(r.name), class: r.name === selected ? "sel" : null,
        onclick: (ev) => { ev.preventDefault(); selected = r.name; setQuery({ stream: r.name }); showTail(r.name); showGroups(r); } }, r.name),
        r.damaged != null ? [" ", h("span", { class: "badge bad", title: r.damaged }, "damaged")] : null] },
      { key: "length", label: "entries", num: true },
      { key: "next", label: "next index", num: true },
      { key: "last_time", label: "last append", render: (r) => fmtTime(r.last_time) },
      { key: "retention", label: "retention", render: (r) => r.damaged != null ? "?" : [r.max_count != null ? `${r.max_count} entries` : null, r.max_age != null ? `${r.max_age} s` : null].filter(Boolean).join(", ") || "all" },
      { key: "tailers", label: "readers (lag)", render: (r) => r.tailers.map((t) => `${t.name} (${t.lag})`).join(", ") || "" },
      { key: "groups", label: "groups (lag / pending)", title: "consumer groups: entries not delivered yet / delivered and not acknowledged",
        render: (r) => (r.groups || []).map((g) => `${g.name} (${g.lag} / ${g.pending})`).join(", ") || "" },
      { key: "published", label: "published", render: (r) => r.published ? "yes" : "" },
    ], data.streams, { empty: "No streams yet: record some with dataspace serve --record STREAM:PATTERN." }),
    broken.length ? h("ul", { class: "damaged" }, broken.map((r) => h("li", { class: "run-note bad" },
      h("code", null, r.name), ` is damaged: ${r.damaged} (dataspace stream info ${r.name} --check says more; restore the store from a backup)`))) : null));
    showGroups(data.streams.find((r) => r.name === selected));
  });
  // The consumer groups of the selected stream: each one's position, lag, pending entries
  // and the consumers holding them.
  const showGroups = (row) => {
    if (!row || !(row.groups || []).length) { groups.replaceChildren(); return; }
    groups.replaceChildren(section(h("span", null, "Consumer groups of ", h("code", null, row.name)), table([
      { key: "name", label: "group" },
      { key: "next", label: "position", num: true, title: "the next index the group delivers" },
      { key: "lag", label: "lag", num: true, title: "entries not delivered to the group yet" },
      { key: "pending", label: "pending", num: true, title: "entries delivered and not acknowledged" },
      { key: "oldest_idle", label: "oldest pending", render: (g) => g.oldest_idle == null ? "" : fmtAge(g.oldest_idle) },
      { key: "consumers", label: "consumers (pending)", render: (g) => g.consumers.length
        ? h("ul", { class: "members consumers" }, g.consumers.map((c) => h("li", { class: "consumer" }, `${c.name}: ${c.pending} pending, oldest ${fmtAge(c.oldest_idle)}`)))
        : "" },
      { key: "settings", label: "settings", render: (g) => [g.idle_timeout == null ? "claimed by hand only" : `idle timeout ${g.idle_timeout} s`,
        g.max_deliveries == null ? null : `at most ${g.max_deliveries} deliveries, then ${g.dead_letter}`,
        g.hold_retention ? null : "does not hold retention"].filter(Boolean).join(", ") },
    ], row.groups, { class: "groups", rowAttrs: () => ({ class: "group" }) })));
  };
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
