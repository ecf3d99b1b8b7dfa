// The observe console: a pattern's + / - / ! events as they arrive.
import { h, $, main, clock, patternError, watch, pageHead, errorBox, patternForm } from "./lib.js";
import { pv } from "./pv.js";

export async function pageObserve() {
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
        line("·", s.presence_only
          ? `synced: ${s.matches ? "something matches" : "nothing matches"} (this token's caveats let it learn only whether something matches, not what); what follows is live`
          : `synced: ${s.matches} current match${s.matches === 1 ? "" : "es"} above; what follows is live`);
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
