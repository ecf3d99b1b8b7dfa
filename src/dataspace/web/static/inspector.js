// The dataspace inspector: pages that read the server's JSON endpoints (/api/...).
// Plain JavaScript modules, no build step, nothing loaded from another host: this entry
// point signs in, marks the page in the menu and runs the page its path names; each
// page is its own module (page-NAME.js), the shared parts are in lib.js and pv.js.
import { h, $, main, api, clearCookie, hasCookie, setupLogin, banner, every, errorBox, setCurrentPage } from "./lib.js";
import { pageOverview } from "./page-overview.js";
import { pageConnections } from "./page-connections.js";
import { pageDataspace } from "./page-dataspace.js";
import { pageObserve } from "./page-observe.js";
import { pageStreams } from "./page-streams.js";
import { pagePipelines } from "./page-pipelines.js";
import { pageLinks } from "./page-links.js";

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
  setCurrentPage(page);
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.page !== page) continue;
    a.classList.add("current");
    a.setAttribute("aria-current", "page");
    // On a phone the menu is one line that scrolls sideways: show this page's entry.
    const nav = a.parentElement;
    if (nav.scrollWidth > nav.clientWidth) nav.scrollLeft = a.offsetLeft - (nav.clientWidth - a.offsetWidth) / 2;
  }
  const ok = await whoAmI();
  if (!ok) return; // the sign-in box is shown
  if (!page) { pageIndex(); return; }
  const fn = PAGES[page];
  if (!fn) { main().replaceChildren(errorBox(new Error(`no page ${page}`))); return; }
  document.title = `${page} · dataspace inspector`;
  main().replaceChildren();
  try { await fn(); } catch (e) { main().append(errorBox(e)); }
}

boot(); // a module runs once the document is parsed
