// Links: the links of this server to other brokers.
import { h, main, fmtTime, api, every, section, pageHead, errorBox } from "./lib.js";

const LINK_MAIN = ["link", "direction", "dataspace", "connected", "since", "peer_id", "last_error"];

export function pageLinks() {
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
