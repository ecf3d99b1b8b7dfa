"""The web inspector in a real browser: Debian's headless Chromium driven by Playwright,
against `dataspace serve --http` in a subprocess, with real clients (`dataspace assert`,
`dataspace send`) in subprocesses and a pipeline run by the local engine on the server's
store.

The tests assert what a person sees on the page, waiting on the page's content with a
bounded timeout (never on sleeps, never on "network idle": the pages keep event streams
open).  Each test saves a screenshot of its page in test-artifacts/inspector/ at the
repository's root (DATASPACE_TEST_ARTIFACTS overrides it); the path is printed.

Chromium missing fails these tests (it is installed by `make test` and .ci/run as root:
`apt-get install chromium`); they are never skipped.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PY = sys.executable
TIMEOUT = 20.0
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("DATASPACE_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "inspector"
CHROMIUM_ARGS = ["--headless", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    """The system Chromium (DATASPACE_CHROMIUM, /usr/bin/chromium or chromium on PATH)."""
    for c in (os.environ.get("DATASPACE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if c and os.access(c, os.X_OK):
            return c
    pytest.fail("the inspector's tests drive Debian's Chromium, and it is not installed: run "
                "`apt-get install chromium` (`make test` and .ci/run do so when run as root), "
                "or set DATASPACE_CHROMIUM to a Chromium binary", pytrace=False)


# ------------------------------------------------------------------------------------
# Processes: `dataspace serve` and its clients, output read by a thread


class Proc:
    """A subprocess whose output (stdout and stderr) is collected line by line."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.p = subprocess.Popen([PY, "-m", "dataspace.cli", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.ended = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def wait_line(self, pattern: str, timeout: float = TIMEOUT) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for s in self.lines:
                    m = rx.search(s)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    raise AssertionError(f"{self.args[0]} did not print {pattern!r}; it printed: "
                                         + "\n".join(self.lines))
                self.cond.wait(left)

    def kill9(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(TIMEOUT)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(TIMEOUT)


class Server:
    """`dataspace serve --http 127.0.0.1:0` (and ``extra``) on loopback."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.data_dir = data_dir
        self.proc = Proc("serve", "--tcp", "127.0.0.1:0", "--data-dir", str(data_dir),
                         "--http", "127.0.0.1:0", *extra)
        self.token = self.proc.wait_line(r"^sturdyref: (.*)$").group(1).strip()
        self.address = self.proc.wait_line(r"listening on ((?:tls://)?127\.0\.0\.1:\d+)").group(1)
        self.url = self.proc.wait_line(r"HTTP on (https?://127\.0\.0\.1:\d+/)").group(1)
        self.proc.wait_line("Ctrl-C stops the server")

    def client(self, command: str, *args: str) -> Proc:
        return Proc(command, *args, "--server", self.address, "--data-dir", str(self.data_dir))

    def send(self, *values: str) -> None:
        r = subprocess.run([PY, "-m", "dataspace.cli", "send", *values, "--server", self.address,
                            "--data-dir", str(self.data_dir)],
                           capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    started: list[Any] = []

    def start(*extra: str) -> Server:
        s = Server(tmp_path / f"data{len(started)}", *extra)
        started.append(s)
        return s

    yield start
    for s in started:
        s.proc.stop()


@pytest.fixture
def clients() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for p in procs:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait(TIMEOUT)


# ------------------------------------------------------------------------------------
# The browser: one Chromium for the module, a fresh context (no cookies) per test


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is not installed: pip install -e '.[test]' (make setup)",
                    pytrace=False)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, timeout=TIMEOUT * 1000)
        yield b
        b.close()


DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}  # an iPhone 12 to 15, in CSS pixels


class Page:
    """A page of a fresh browser context; ``errors`` collects script errors."""

    def __init__(self, browser: Any, name: str, viewport: dict[str, int] = DESKTOP) -> None:
        self.name = name
        self.context = browser.new_context(viewport=viewport)
        self.page = self.context.new_page()
        self.page.set_default_timeout(10_000)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def goto(self, url: str) -> Any:
        # Never "networkidle": the pages keep event streams open.
        self.page.goto(url, wait_until="domcontentloaded")
        return self.page

    def screenshot(self, suffix: str = "") -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{self.name}{suffix}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Page]:
    yield from _page(browser, request, DESKTOP)


@pytest.fixture
def phone(browser: Any, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A page the size of a phone's screen."""
    yield from _page(browser, request, PHONE)


def _page(browser: Any, request: pytest.FixtureRequest, viewport: dict[str, int]
          ) -> Iterator[Page]:
    name = request.node.name.removeprefix("test_")
    p = Page(browser, name, viewport)
    (ARTIFACTS / f"{name}-failed.png").unlink(missing_ok=True)
    failures = request.session.testsfailed
    yield p
    if request.session.testsfailed > failures:  # the test failed: show what the page showed
        p.screenshot("-failed")
    p.context.close()
    assert not p.errors, f"script errors on the page: {p.errors}"


def expect(x: Any) -> Any:
    from playwright.sync_api import expect as pw_expect

    return pw_expect(x)


# ------------------------------------------------------------------------------------
# The tests


def test_an_assertion_appears_within_a_second_and_goes_when_its_client_is_killed(
        serve: Any, clients: list[Proc], page: Page) -> None:
    srv = serve()  # tokens required: the page asks for one
    pg = page.goto(srv.url + "inspector/dataspace?pattern=" + "%3CPresent%20%24who%3E")
    expect(pg.locator("#login")).to_be_visible()
    pg.fill("#token", '<ref {oid: "root" sig: #x"' + "00" * 16 + '"}>')
    pg.click("#login button[type=submit]")
    expect(pg.locator("#login-error")).to_contain_text("not a capability of this server")
    pg.fill("#token", srv.token)
    pg.click("#login button[type=submit]")  # sets the cookie and reloads the page
    expect(pg.locator("#status")).to_have_text("live")
    expect(pg.locator("#login")).to_be_hidden()
    expect(pg.locator("#who")).to_contain_text("admin")
    expect(pg.locator("#pattern")).to_have_value("<Present $who>")
    rows = pg.locator("#assertions td.value")
    expect(rows).to_have_count(0)

    alice = srv.client("assert", '<Present "alice">')
    clients.append(alice)
    alice.wait_line("asserted")  # the server has it (the client synced)
    t0 = time.monotonic()
    expect(rows).to_have_text(['<Present "alice">'], timeout=1000)
    print(f"shown {time.monotonic() - t0:.3f} s after the client's sync")
    expect(pg.locator("#count")).to_have_text("1 matching")
    page.screenshot()

    alice.kill9()
    expect(rows).to_have_count(0, timeout=5000)
    expect(pg.locator("#count")).to_have_text("0 matching")
    expect(pg.locator("#status")).to_have_text("live")
    page.screenshot("-after-kill")


def test_values_with_angle_brackets_show_as_text_and_references_readably(
        serve: Any, clients: list[Proc], page: Page) -> None:
    srv = serve("--http-open")  # an open server needs no token
    note = '<Note "a <b>bold</b> & <script>window.hacked = 1</script> <Present \\"x\\">">'
    c = srv.client("assert", note, '<Present "bob">')
    clients.append(c)
    c.wait_line("asserted")
    pg = page.goto(srv.url + "inspector/dataspace")
    expect(pg.locator("#login")).to_be_hidden()
    expect(pg.locator("#who")).to_contain_text("open")
    expect(pg.locator("#pattern")).to_have_value("_")
    values = pg.locator("#assertions td.value")
    expect(values.filter(has_text=re.compile("^<Note"))).to_have_text([note])
    expect(values.filter(has_text=re.compile("^<Present"))).to_have_text(['<Present "bob">'])
    # Nothing of the value became markup.
    assert pg.locator("#assertions b, #assertions script, #assertions Present").count() == 0
    assert pg.evaluate("window.hacked") is None
    # The page's own watch is an <Observe ...> whose observer is a reference, shown readably.
    emb = pg.locator("#assertions .pv-emb").first
    expect(emb).to_have_text(re.compile(r'^#:<object "_Watcher">$'))
    # The captures column and the patterns observed are text too.
    pg.fill("#pattern", "<Note $text>")
    pg.click("#go")
    expect(pg.locator("#assertions td.captures")).to_have_text(
        ['"a <b>bold</b> & <script>window.hacked = 1</script> <Present \\"x\\">"'])
    expect(pg.locator("#status")).to_have_text("live")
    page.screenshot()


def test_a_message_sent_to_a_typed_pattern_appears_in_the_observe_console(
        serve: Any, page: Page) -> None:
    srv = serve("--http-open")
    pg = page.goto(srv.url + "inspector/observe")
    pg.fill("#pattern", '<Says "dan" $text>')
    pg.click("#go")
    expect(pg.locator("#status")).to_have_text("live")
    expect(pg.locator("#events li").last).to_contain_text("synced: 0 current matches")
    srv.send('<Says "eve" "not for this pattern">', '<Says "dan" "hello <world>">')
    got = pg.locator('#events li[data-kind="!"] .v')
    expect(got).to_have_text(['<Says "dan" "hello <world>">'], timeout=2000)
    expect(pg.locator("#events")).not_to_contain_text("eve")
    page.screenshot()


def test_a_bad_pattern_shows_the_parsers_message_with_the_position(
        serve: Any, page: Page) -> None:
    srv = serve("--http-open")
    pg = page.goto(srv.url + "inspector/observe")
    expect(pg.locator("#status")).to_have_text("live")  # the default pattern
    pg.fill("#pattern", '<Says "dan" $text')
    pg.click("#go")
    err = pg.locator("#pattern-error .pattern-error")
    expect(err).to_be_visible()
    expect(err).to_contain_text("bad pattern: text ended inside '<' opened at position 0")
    expect(err).to_contain_text("(line 1, column 18)")
    expect(err.locator("pre.caret .src")).to_have_text('<Says "dan" $text')
    # The caret stands under the column the parser named (column 18: after the text).
    mark = err.locator("pre.caret .mark").text_content() or ""
    assert mark == " " * 17 + "^", repr(mark)
    expect(pg.locator("#status")).to_have_text("stopped")
    page.screenshot()
    # The same on the dataspace browser; a good pattern afterwards clears it.
    pg = page.goto(srv.url + "inspector/dataspace")
    pg.fill("#pattern", "<Present [$x")
    pg.click("#go")
    expect(pg.locator("#pattern-error")).to_contain_text("bad pattern:")
    expect(pg.locator("#pattern-error pre.caret .mark")).to_have_count(1)
    pg.fill("#pattern", "<Present $x>")
    pg.click("#go")
    expect(pg.locator("#status")).to_have_text("live")
    expect(pg.locator("#pattern-error")).to_be_empty()


def test_the_pipeline_page_shows_lag_falling_as_the_pipeline_catches_up(
        serve: Any, page: Page) -> None:
    from dataspace.pipeline import Graph
    from dataspace.pipeline.local import LocalEngine
    from dataspace.streams import open_store
    from dataspace.values import parse

    srv = serve("--http-open")
    store = open_store(srv.data_dir)  # the server's own store, from this process
    try:
        g = Graph("shout")
        g.source("words")
        g.map("upper", "words", "loud", lambda s: s.upper())
        g.map("count", "loud", "lengths", lambda s: len(s))
        store.append_many("words", [parse(f'"w{i}"') for i in range(20)])
        with LocalEngine(g, store) as eng:
            eng.run(until_idle=True)
        store.append_many("words", [parse(f'"x{i}"') for i in range(30)])

        pg = page.goto(srv.url + "inspector/pipelines")
        lag = pg.locator('svg.graph g.edge[data-from="words"][data-to="upper"] text.edge-lag')
        expect(lag).to_have_text("lag 30", timeout=5000)
        expect(pg.locator('svg.graph g.edge[data-from="loud"][data-to="count"] text.edge-lag')
               ).to_have_text("lag 0")
        expect(pg.locator('[data-graph="shout"] .lag-total')).to_have_text("total lag 30")
        # No engine holds the graph: the page says so, and that the lag will not move.
        card = pg.locator('[data-graph="shout"]')
        expect(card.locator(".run-state")).to_have_text("not running")
        expect(card.locator(".run-note")).to_contain_text(
            "No engine runs this graph: 30 waiting entries do not move until one is started")
        expect(card.locator(".run-note")).to_contain_text("last step ")
        page.screenshot("-behind")

        # Ten entries a step, one step per round: the page follows the lag down.
        with LocalEngine(g, store, batch=10, commit="each-write") as eng:
            eng.start()
            expect(card.locator(".run-state")).to_have_text("running")
            expect(card.locator(".run-note")).to_contain_text(f"Running: pid {os.getpid()}")
            eng.run_round()
            expect(lag).to_have_text("lag 20", timeout=5000)
            eng.run_round()
            expect(lag).to_have_text("lag 10", timeout=5000)
            eng.run(until_idle=True)
        expect(lag).to_have_text("lag 0", timeout=5000)
        expect(card.locator(".run-state")).to_have_text("not running")
        expect(card.locator(".run-note")).to_contain_text("new entries will wait until one is started")
        expect(pg.locator('[data-graph="shout"] .lag-total')).to_have_text("total lag 0")
        expect(pg.locator('svg.graph g.node[data-name="lengths"] text.sub')
               ).to_have_text("50 entries · output")
        page.screenshot()
        # Its source's bookkeeping damaged: the graph is still drawn, and says which
        # stream and what to do (the page showed only the API's error before).
        from store_damage import Raw

        raw = Raw(str(srv.data_dir))
        assert raw.flip_column("streams", "next_index", 5, "words")  # 50 -> 18
        raw.close()
        damaged = card.locator(".run-note.damaged")
        expect(damaged).to_contain_text("Damaged: words (", timeout=5000)
        expect(damaged).to_contain_text("restore the store from a backup")
        expect(pg.locator('[data-graph="shout"] svg.graph')).to_have_count(1)
    finally:
        store.close()


def test_every_page_shows_the_server(serve: Any, clients: list[Proc], page: Page) -> None:
    srv = serve("--http-open", "--record", "chat:<Says $who $text>")
    c = srv.client("assert", '<Present "alice">')
    clients.append(c)
    c.wait_line("asserted")
    srv.send('<Says "alice" "hi">', '<Says "bob" "hello <there>">', '<Says "carol" "bye">')

    pg = page.goto(srv.url)
    expect(pg.locator("main .pages a")).to_have_count(7)
    expect(pg.locator(".health")).to_contain_text("ready")
    page.screenshot()
    for link in pg.locator("#nav a").all():
        href = link.get_attribute("href") or ""
        assert re.fullmatch(r"/inspector/[a-z]+", href), href

    pg = page.goto(srv.url + "inspector/overview")
    expect(pg.locator('.counter[data-key="connections"] .counter-value')).to_have_text("1")
    expect(pg.locator('.counter[data-key="connections"] svg.spark polyline')).to_have_count(2)
    expect(pg.locator("main")).to_contain_text("chat<Says $who $text>3")  # the recorder
    page.screenshot("-overview")

    pg = page.goto(srv.url + "inspector/connections")
    expect(pg.locator("table.connections tbody tr")).to_have_count(1)
    expect(pg.locator("table.connections tbody tr")).to_contain_text("127.0.0.1:")
    page.screenshot("-connections")

    pg = page.goto(srv.url + "inspector/streams")
    pg.get_by_role("link", name="chat", exact=True).click()
    entries = pg.locator("#entries td.value")
    expect(entries).to_have_text(['<Says "alice" "hi">', '<Says "bob" "hello <there>">',
                                  '<Says "carol" "bye">'])
    pg.fill("#search", "BOB")
    expect(entries).to_have_text(['<Says "bob" "hello <there>">'])
    srv.send('<Says "bob" "again">', '<Says "dan" "not bob">')  # followed live
    expect(entries).to_have_text(['<Says "bob" "hello <there>">', '<Says "bob" "again">',
                                  '<Says "dan" "not bob">'])
    page.screenshot("-streams")

    pg = page.goto(srv.url + "inspector/links")
    expect(pg.locator("main")).to_contain_text("No links.")
    page.screenshot("-links")


def test_the_servers_own_observers_are_marked_and_listed_after_the_clients(
        serve: Any, clients: list[Proc], page: Page) -> None:
    """Issue 28: the page's own watch and the recorders showed in "Observed patterns" as
    if a client observed `<$ <Present $>>`.  They are real subscriptions (links upstream
    them), listed after the clients', each marked as the server's."""
    srv = serve("--http-open", "--record", "chat:<Says $who $text>")
    clients.append(srv.client("observe", "<Present $who>"))
    pg = page.goto(srv.url + "inspector/dataspace?pattern=" + "%3CPresent%20%24who%3E")
    expect(pg.locator("#status")).to_have_text("live")
    rows = pg.locator("table.grid tbody tr.client, table.grid tbody tr.own")
    expect(rows).to_have_count(3, timeout=TIMEOUT * 1000)  # the list is read every 3 s
    expect(rows.nth(0)).to_have_class(re.compile(r"\bclient\b"))
    expect(rows.nth(0).locator('td[data-col="pattern"]')).to_have_text("<Present $>")
    expect(rows.nth(0).locator(".own")).to_have_count(0)
    own = {rows.nth(i).locator('td[data-col="pattern"]').inner_text() for i in (1, 2)}
    assert own == {"<$ <Present $>> server: watch", "<$ <Says $who $text>> server: recorder chat"}, own
    for i in (1, 2):
        expect(rows.nth(i)).to_have_class(re.compile(r"\bown\b"))
    page.screenshot()
    # The endpoint says the same: what is the server's own, and whose it is.
    r = urllib.request.urlopen(srv.url + "api/subscriptions", timeout=TIMEOUT)
    pats = [(p["pattern"], p["own"]) for p in json.loads(r.read())["patterns"]]
    assert pats[0] == ("<Present $>", None)
    assert sorted(pats[1:], key=str) == sorted([("<$ <Present $>>", "watch"),
                                                ("<$ <Says $who $text>>", "recorder chat")], key=str)


def test_pages_are_utf8_from_this_server_only() -> None:
    """Every file of the inspector is UTF-8 with its type; nothing is loaded from another
    host, and the script never parses server text as HTML."""
    from dataspace.web import inspector

    static = Path(inspector.__file__).with_name("static")
    html = (static / "inspector.html").read_text("utf-8")
    for ref in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert ref.startswith("/") or ref == "data:,", ref
    scripts = {p.name: p.read_text("utf-8") for p in static.glob("*.js")}
    assert {"inspector.js", "lib.js", "pv.js", "page-links.js"} <= set(scripts)
    for name, text in scripts.items():  # every module imported is a file of static/
        for ref in re.findall(r'^import .* from "([^"]+)";$', text, re.M):
            assert ref.startswith("./") and ref[2:] in scripts, (name, ref)
    js = "\n".join(scripts.values())
    # Every file is package data (pyproject's globs), so an installed server has it.
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"]["setuptools"][
        "package-data"]["dataspace.web"]
    for f in static.iterdir():
        assert any(fnmatch.fnmatch("static/" + f.name, g) for g in globs), f.name
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):
        assert sink not in js, sink
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", js + html)
    css = (static / "inspector.css").read_text("utf-8")
    assert "url(" not in css and "@import" not in css


def test_pages_are_served_with_their_types(serve: Any) -> None:
    srv = serve()

    def get(path: str) -> tuple[int, dict[str, str], bytes]:
        try:
            with urllib.request.urlopen(srv.url + path, timeout=TIMEOUT) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    for path in ("", "inspector/overview", "inspector/pipelines"):
        status, headers, body = get(path)
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8", path
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        assert b'<meta charset="utf-8">' in body
    for name in ("inspector.js", "lib.js", "pv.js", "page-dataspace.js"):
        status, headers, _ = get("inspector/static/" + name)
        assert status == 200 and headers["Content-Type"] == "text/javascript; charset=utf-8"
    status, headers, _ = get("inspector/static/inspector.css")
    assert status == 200 and headers["Content-Type"] == "text/css; charset=utf-8"
    assert get("inspector/nope")[0] == 404
    assert get("inspector/static/nope.js")[0] == 404
    # The pages hold no data; the API behind them still asks for the token.
    assert get("api/server")[0] == 401


def test_a_token_with_caveats_sees_what_they_allow(serve: Any, clients: list[Proc],
                                                   page: Page) -> None:
    srv = serve()
    r = subprocess.run([PY, "-m", "dataspace.cli", "cap", "attenuate", srv.token,
                        "--only", "<rec Observe [<_> <_>]>"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    observer_only = r.stdout.strip()
    c = srv.client("assert", '<Present "alice">')
    clients.append(c)
    c.wait_line("asserted")
    pg = page.goto(srv.url + "inspector/dataspace?pattern=%3CPresent%20%24who%3E")
    pg.fill("#token", observer_only)
    pg.click("#login button[type=submit]")
    expect(pg.locator("#who")).to_have_text(re.compile("dataspace:root"))
    expect(pg.locator("#status")).to_have_text("live")
    # What its subscription would be told: the captures, references hidden.
    expect(pg.locator("#assertions td.value")).to_have_text(['<Present "alice">'])
    pg = page.goto(srv.url + "inspector/streams")
    expect(pg.locator(".error-box")).to_contain_text("needs the server's root capability")
    pg = page.goto(srv.url + "inspector/pipelines")  # one line, in English
    expect(pg.locator(".error-box")).to_have_text(re.compile(
        r"^reading the pipelines needs the server's root capability \(this token reaches "
        r"dataspace 'root' through its caveats\); sign in with DATA_DIR/root.sturdyref$"))
    pg = page.goto(srv.url + "inspector/connections")
    expect(pg.locator("p.count")).to_contain_text("1 connection")
    expect(pg.locator("p.count")).to_contain_text("connection details need the root capability")
    page.screenshot()
    pg.click("#signout")
    expect(pg.locator("#login")).to_be_visible()


def _attenuate(srv: Server, *only: str) -> str:
    args = [a for p in only for a in ("--only", p)]
    r = subprocess.run([PY, "-m", "dataspace.cli", "cap", "attenuate", srv.token, *args],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _sign_in(pg: Any, token: str) -> None:
    expect(pg.locator("#login")).to_be_visible()
    pg.fill("#token", token)
    pg.click("#login button[type=submit]")  # sets the cookie and reloads the page
    expect(pg.locator("#who")).to_have_text(re.compile("dataspace:root"))


def test_an_attenuated_token_browsing_everything_sees_each_value(
        serve: Any, clients: list[Proc], page: Page) -> None:
    """The default pattern `_` with a token that may observe anything: each assertion,
    whole, as for the administrator -- not "1 matching" and one `_` row (a pattern
    without captures tells its observer only whether something matches)."""
    srv = serve()
    observer_only = _attenuate(srv, "<rec Observe [<_> <_>]>")
    c = srv.client("assert", '<Present "alice">', '<Present "bob">')
    clients.append(c)
    c.wait_line("asserted")
    pg = page.goto(srv.url + "inspector/dataspace")
    _sign_in(pg, observer_only)
    expect(pg.locator("#pattern")).to_have_value("_")
    expect(pg.locator("#status")).to_have_text("live")
    values = pg.locator("#assertions td.value")
    expect(values.filter(has_text=re.compile("^<Present"))).to_have_text(
        ['<Present "alice">', '<Present "bob">'])
    texts = values.all_text_contents()
    assert "_" not in texts, texts
    # Every value is a row (the page's own watch is an assertion too), counted right.
    expect(pg.locator("#count")).to_have_text(f"{len(texts)} matching")
    assert len(texts) >= 3, texts
    # The captures column holds what `_` captures: nothing.
    expect(pg.locator("#assertions td.captures").first).to_have_text("")
    page.screenshot()


def test_a_token_that_may_not_see_values_is_told_only_whether_something_matches(
        serve: Any, clients: list[Proc], page: Page) -> None:
    srv = serve()
    presence = _attenuate(srv, "<rec Observe [<rec group [<rec rec [<lit Present>]> <_>]> <_>]>")
    c = srv.client("assert", '<Present "alice">', '<Present "bob">')
    clients.append(c)
    c.wait_line("asserted")
    pg = page.goto(srv.url + "inspector/dataspace?pattern=%3CPresent%20_%3E")
    _sign_in(pg, presence)
    expect(pg.locator("#status")).to_have_text("live")
    expect(pg.locator("#count")).to_have_text(re.compile(
        r"^something matches \(this token's caveats let it learn only whether"))
    # With a capture it sees the captures, one row each.
    pg.fill("#pattern", "<Present $who>")
    pg.click("#go")
    expect(pg.locator("#assertions td.captures")).to_have_text(['"alice"', '"bob"'])
    expect(pg.locator("#count")).to_have_text("2 matching")


def test_the_links_page_is_a_table_with_states_reasons_and_formatted_bytes(
        serve: Any, clients: list[Proc], page: Page) -> None:
    a = serve("--http-open")
    b = serve("--http-open", "--link", a.address, "--link-cap", a.token,
              "--link", "127.0.0.1:1", "--link-cap", a.token)  # nobody listens on port 1
    b.proc.wait_line(rf"link {re.escape(a.address)}: up")
    watcher = a.client("observe", "<Says $who $text>")  # a wants b's messages
    clients.append(watcher)
    pg = page.goto(b.url + "inspector/links")
    rows = pg.locator("table.links tbody tr")
    expect(rows).to_have_count(2)
    expect(pg.locator("p.count")).to_have_text("2 links, 1 up")
    up = pg.locator(f'table.links tr[data-link="{a.address}"]')
    expect(up.locator('td[data-col="subscriptions"]')).to_contain_text("peer wants 1")
    b.send(*(f'<Says "b" "message {i} {"x" * 200}">' for i in range(40)))  # bytes to format
    watcher.wait_line("message 39")
    expect(up.locator('td[data-col="messages_forwarded"]')).to_have_text("40")
    expect(up.locator('td[data-col="state"] .badge')).to_have_text("up")
    expect(up.locator('td[data-col="link"]')).to_contain_text(f"→ to {a.address}")
    expect(up.locator('td[data-col="peer_id"]')).to_have_text(re.compile(r"^[0-9a-f]{16}$"))
    expect(up.locator('td[data-col="since"]')).to_have_text(re.compile(r"^(\d+ min )?\d+(\.\d)? s$"))
    expect(up.locator('td[data-col="subscriptions"]')).to_contain_text("upstreamed")
    # Bytes as people read them, never a raw count; the headings say what they count.
    human = re.compile(r"^\d+(\.\d)? (B|KiB|MiB)$")
    expect(up.locator('td[data-col="bytes_out"]')).to_have_text(human)
    expect(up.locator('td[data-col="bytes_in"]')).to_have_text(human)
    expect(up.locator('td[data-col="bytes_out"]')).to_contain_text("KiB")  # > 8 KiB sent
    heads = pg.locator("table.links thead th").all_text_contents()
    assert heads == ["link", "state", "up for", "peer", "subscriptions", "msgs forwarded",
                     "suppressed", "received", "bytes out", "bytes in"], heads
    down = pg.locator('table.links tr[data-link="127.0.0.1:1"]')
    expect(down.locator('td[data-col="state"] .badge')).to_have_text("down")
    expect(down.locator('td[data-col="state"] .reason')).to_contain_text(
        "no server at 127.0.0.1:1 (connection refused)")
    expect(down.locator('td[data-col="state"]')).to_contain_text(re.compile(r"\d+ attempts?"))
    expect(down.locator('td[data-col="since"]')).to_have_text("\u2013")  # an en dash: nothing to say
    # Every counter, formatted, one click away; no raw JSON anywhere.
    pg.locator(f'details[data-link="{a.address}"] summary').click()
    facts = pg.locator(f'details[data-link="{a.address}"] dl.facts')
    expect(facts).to_contain_text("messages suppressed")
    expect(facts.locator("dd").first).to_be_visible()
    assert "{" not in (pg.locator("main").text_content() or "")
    page.screenshot()


def test_the_links_page_shows_the_cluster_its_members_and_routes(
        serve: Any, clients: list[Proc], page: Page, tmp_path: Path) -> None:
    from dataspace.broker.cluster import make_secret

    secret = tmp_path / "cluster.secret"
    secret.write_text(make_secret())
    secret.chmod(0o600)
    a = serve("--http-open", "--cluster", "127.0.0.1:0", "--cluster-secret", str(secret))
    route_a = a.proc.wait_line(r"routes on (127\.0\.0\.1:\d+)").group(1)
    b = serve("--http-open", "--cluster", "127.0.0.1:0", "--cluster-secret", str(secret),
              "--routes", route_a)
    b.proc.wait_line(rf"route to {re.escape(route_a)}: up")
    watcher = a.client("observe", "<Says $who $text>")  # a wants b's messages
    clients.append(watcher)
    pg = page.goto(b.url + "inspector/links")
    card = pg.locator("section.cluster")
    expect(card.locator("p.count")).to_have_text(re.compile(
        r"^cluster dataspace: member [0-9a-f]{16} at 127\.0\.0\.1:\d+; 2 of 2 members up, "
        r"1 route up$"))
    row = card.locator(f'table.routes tr[data-link="{route_a}"]')
    expect(row.locator('td[data-col="state"] .badge')).to_have_text("up")
    expect(row.locator('td[data-col="link"]')).to_contain_text("cluster route")
    expect(row.locator('td[data-col="subscriptions"]')).to_contain_text("peer wants 1")
    b.send('<Says "b" "over the route">')
    watcher.wait_line("over the route")
    expect(row.locator('td[data-col="messages_forwarded"]')).to_have_text("1")
    expect(pg.locator("p.empty")).to_contain_text("No links.")  # (routes are not links)
    page.screenshot()


def test_the_links_page_says_what_the_cluster_records_into_a_shared_store(
        serve: Any, page: Page, tmp_path: Path) -> None:
    """Recording in a cluster (docs/cluster.md): the card says the store is shared, one
    stream for the cluster, and which member leads each stream."""
    from dataspace.broker.cluster import make_secret

    secret = tmp_path / "cluster.secret"
    secret.write_text(make_secret())
    secret.chmod(0o600)
    rec = ("--record", "chat:<Says $who $text>", "--store", str(tmp_path / "shared"))
    a = serve("--http-open", "--cluster", "127.0.0.1:0", "--cluster-secret", str(secret), *rec)
    route_a = a.proc.wait_line(r"routes on (127\.0\.0\.1:\d+)").group(1)
    b = serve("--http-open", "--cluster", "127.0.0.1:0", "--cluster-secret", str(secret),
              "--routes", route_a, *rec)
    b.proc.wait_line(rf"route to {re.escape(route_a)}: up")
    pg = page.goto(b.url + "inspector/links")
    line = pg.locator("section.cluster p.recording")
    expect(line).to_contain_text(re.compile(
        r"^recording into .*shared/streams\.sqlite3, shared with every other member: one "
        r"stream for the cluster, each message once; chat led by (this member|member "
        r"[0-9a-f]{16})$"))
    page.screenshot()


# What sticks out of a phone's screen: every element whose box leaves the viewport and is
# not inside a container that scrolls sideways (a table's wrapper, the menu, a graph),
# and every such container that itself leaves it.
_OVERFLOW_JS = """() => {
  const vw = document.documentElement.clientWidth;
  const scrolls = (el) => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
  const out = [];
  for (const el of document.querySelectorAll("body *")) {
    const r = el.getBoundingClientRect();
    if (!r.width || !r.height || getComputedStyle(el).visibility === "hidden") continue;
    if (r.left >= -0.5 && r.right <= vw + 0.5) continue;
    let a = el.parentElement;
    while (a && !scrolls(a)) a = a.parentElement;
    if (a) continue;
    out.push(`${el.tagName.toLowerCase()}.${el.className.baseVal ?? el.className} ` +
             `${Math.round(r.left)}..${Math.round(r.right)}`);
  }
  return {width: vw, scrollWidth: document.documentElement.scrollWidth,
          header: document.querySelector("header.top").getBoundingClientRect().height,
          out: out.slice(0, 10)};
}"""


def _fits_a_phone(page: Page, what: str) -> None:
    pg = page.page
    m = pg.evaluate(_OVERFLOW_JS)
    assert m["width"] == PHONE["width"], m
    assert m["header"] < 80, f"{what}: the header is {m['header']:.0f} px tall"
    assert m["scrollWidth"] <= m["width"], f"{what}: the page scrolls sideways ({m})"
    assert not m["out"], f"{what}: cut off at the screen's edge: {m['out']}"
    # The menu shows the current page's entry, whole.
    cur = pg.locator("#nav a.current")
    if cur.count():
        box = cur.bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], (what, box)
    page.screenshot("-" + what)


def test_every_page_fits_a_phone(serve: Any, clients: list[Proc], phone: Page) -> None:
    """At 390 x 844: a header under 80 px, nothing cut off or scrolling the page sideways
    (wide tables and the graph scroll inside their card), each page's content shown."""
    from dataspace.pipeline import Graph
    from dataspace.pipeline.local import LocalEngine
    from dataspace.streams import open_store
    from dataspace.values import parse

    a = serve("--http-open")
    srv = serve("--http-open", "--record", "chat:<Says $who $text>",
                "--link", a.address, "--link-cap", a.token, "--link", "127.0.0.1:1",
                "--link-cap", a.token)
    c = srv.client("assert", '<Present "alice">', '<Note "a rather long note that has to '
                   'wrap somewhere on a narrow screen, or scroll">')
    clients.append(c)
    c.wait_line("asserted")
    srv.send('<Says "alice" "hi">', '<Says "bob" "a longer message, with words to wrap">')
    store = open_store(srv.data_dir)
    try:
        g = Graph("shout")
        g.source("words")
        g.map("upper", "words", "loud", lambda s: s.upper())
        g.map("count", "loud", "lengths", lambda s: len(s))
        store.append_many("words", [parse(f'"w{i}"') for i in range(5)])
        with LocalEngine(g, store) as eng:
            eng.run(until_idle=True)
    finally:
        store.close()

    pg = phone.goto(srv.url)
    expect(pg.locator(".health")).to_contain_text("ready")
    _fits_a_phone(phone, "index")
    checks = {
        "overview": ('.counter[data-key="connections"] .counter-value', "1"),
        "connections": ("table.connections tbody tr", "127.0.0.1:"),
        "dataspace": ("#assertions", '<Present "alice">'),
        "observe": ("#events", "synced:"),
        "streams?stream=chat": ("#entries", '<Says "bob"'),
        "pipelines": ('[data-graph="shout"] .run-state', "not running"),
        "links": ("table.links", "no server at 127.0.0.1:1"),
    }
    for path, (sel, text) in checks.items():
        pg = phone.goto(srv.url + "inspector/" + path)
        expect(pg.locator("h1")).to_be_visible()
        expect(pg.locator(sel).first).to_contain_text(text)
        expect(pg.locator(sel).first).to_be_visible()
        _fits_a_phone(phone, path.split("?")[0])
    # A wide table scrolls inside its card: its wrapper is narrower than the table.
    pg = phone.goto(srv.url + "inspector/connections")
    expect(pg.locator("table.connections tbody tr")).to_have_count(1)
    widths = pg.evaluate("""() => { const w = document.querySelector(".table-wrap");
        return [w.clientWidth, w.scrollWidth]; }""")
    assert widths[1] > widths[0], widths
    pg.locator(".table-wrap").evaluate("w => { w.scrollLeft = w.scrollWidth; }")
    expect(pg.locator('table.connections td[data-col="held"]')).to_be_in_viewport()


def test_the_sign_in_box_fits_a_phone(serve: Any, phone: Page) -> None:
    srv = serve()
    pg = phone.goto(srv.url + "inspector/overview")
    expect(pg.locator("#login")).to_be_visible()
    _fits_a_phone(phone, "sign-in")
    pg.fill("#token", srv.token)
    pg.click("#login button[type=submit]")
    expect(pg.locator("#signout")).to_be_in_viewport()
    expect(pg.locator('.counter[data-key="connections"]')).to_be_visible()
    _fits_a_phone(phone, "signed-in")


def test_the_inspector_over_https(serve: Any, browser: Any, tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    srv = serve("--tls-cert", str(cert), "--tls-key", str(key))
    assert srv.url.startswith("https://") and srv.address.startswith("tls://")
    # The browser is not given the test CA: it accepts the certificate as a person who
    # checked it would; what is tested is that the inspector works over HTTPS.
    context = browser.new_context(viewport=DESKTOP, ignore_https_errors=True)
    try:
        pg = context.new_page()
        pg.set_default_timeout(10_000)
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(srv.url + "inspector/dataspace", wait_until="domcontentloaded")
        expect(pg.locator("#login")).to_be_visible()
        pg.fill("#token", srv.token)
        pg.click("#login button[type=submit]")
        expect(pg.locator("#status")).to_have_text("live")  # its event stream, over TLS
        expect(pg.locator("#who")).to_contain_text("admin")
        cookie = next(c for c in context.cookies() if c["name"] == "dataspace_token")
        assert cookie["secure"], cookie  # never sent over plain HTTP
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(ARTIFACTS / "inspector_over_https.png"), full_page=True)
        assert not errors, errors
    finally:
        context.close()
