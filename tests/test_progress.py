"""The progress helper (dataspace.progress): a bar with rate and ETA on a terminal, plain
periodic lines otherwise; and the commands that use it."""

from __future__ import annotations

from dataspace.cli.pipeline import format_progress
from dataspace.pipeline.engine import ProcStats
from dataspace.progress import Progress, hms


class Out:
    def __init__(self, tty: bool) -> None:
        self.text = ""
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_plain_lines_every_interval_only_when_something_moved_and_the_last():
    now = [0.0]
    out = Out(False)
    p = Progress(out, total=1000, what="kills", verb="crash test", interval=5.0,
                 clock=lambda: now[0], header="crash test: 1000 kills")
    for t, done in [(0, 0), (1, 10), (5, 50), (6, 60), (10, 100), (10.5, 100), (16, 100)]:
        now[0] = t
        p(done)
    now[0] = 20.0
    p.finish()
    assert out.text.splitlines() == [
        "crash test: 1000 kills",
        "crash test 50/1,000 kills (5%), 10/s, ETA 1:35",
        "crash test 100/1,000 kills (10%), 10/s, ETA 1:30",
        "crash test 100/1,000 kills (10%), 6/s, ETA 2:24",  # the rate moved
        "crash test 100/1,000 kills (10%), 5/s, ETA 3:00",  # the last, at the end
    ]


def test_a_bar_on_a_terminal_cut_to_its_width_and_closed_at_the_end():
    now = [0.0]
    out = Out(True)
    p = Progress(out, total=200, what="entries", clock=lambda: now[0], redraw=0.5)
    now[0] = 1.0
    p(50, note="lag chat:150")
    now[0] = 1.2
    p(60)  # within the redraw interval: not drawn
    now[0] = 2.0
    p(200)
    assert out.text.startswith("\r[######..................] 50/200 entries (25%), 50/s, "
                               "ETA 0:03 | lag chat:150")
    assert "60/200" not in out.text
    assert out.text.endswith("\n")
    assert out.text.rstrip().endswith("200/200 entries (100%), 100/s, 0:02 | lag chat:150")
    p.finish()  # already closed: nothing more
    assert out.text.count("\n") == 1


def test_without_a_total_quiet_and_the_words():
    now = [0.0]
    out = Out(False)
    p = Progress(out, what="messages", verb="sent", clock=lambda: now[0], interval=1.0)
    now[0] = 2.0
    p.advance(500)
    p.advance(500)
    now[0] = 4.0
    p.advance(1000)
    assert out.text.splitlines() == ["sent 500 messages, 250/s, 0:02",
                                     "sent 2,000 messages, 500/s, 0:04"]
    q = Progress(out, total=10, quiet=True, clock=lambda: now[0])
    now[0] = 9.0
    q(5)
    q.finish()
    assert q.text() == "5/10 items (50%), 1/s, ETA 0:05"
    assert out.text.count("\n") == 2  # quiet: nothing written
    assert Progress(out, total=600, what="s", rate=False, clock=lambda: now[0]).text() == \
        "0/600 s (0%), ETA -"
    assert hms(59.6) == "1:00" and hms(3725) == "1:02:05"


def test_pipeline_progress_says_when_the_lag_will_be_caught_up():
    stats = [ProcStats("p", "map", 100, 100, 0, 3, {"in": 500})]
    assert format_progress(stats, 50.0).endswith("| 50 msg/s, catching up: ETA 0:10")
    idle = [ProcStats("p", "map", 100, 100, 0, 3, {"in": 0})]
    assert format_progress(idle, 50.0).endswith("| 50 msg/s")


def test_other_output_does_not_garble_the_bar():
    now = [0.0]
    bar_out, other = Out(True), Out(False)
    p = Progress(bar_out, total=4, what="steps", rate=False, clock=lambda: now[0], redraw=0.0)
    p.advance()
    p.echo("a result", file=other)
    assert other.text == "a result\n"
    # The bar was cleared (spaces over it), then drawn again.
    assert bar_out.text.count("[######") == 2 and "\r" + " " * 10 in bar_out.text
    plain = Out(False)
    q = Progress(plain, total=4, clock=lambda: now[0])
    q.echo("x", file=plain)
    assert plain.text == "x\n"
