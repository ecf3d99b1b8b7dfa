"""The progress helper (dataspace.progress): a bar with rate and ETA on a terminal, plain
periodic lines otherwise; and the commands that use it."""

from __future__ import annotations

import itertools
import os
import threading

import pytest

from dataspace.cli.pipeline import format_progress
from dataspace.pipeline.engine import ProcStats
from dataspace.progress import Eta, LiveLine, Progress, WallRate, hms


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


def test_an_estimated_total_is_said_as_one_until_the_end():
    """An import's total is estimated from the share of the file read: it was shown as
    exact ("imported 10,000/21,016 entries" for a 19,999-entry file)."""
    now = [0.0]
    out = Out(False)
    p = Progress(out, what="entries", verb="imported", interval=1.0, clock=lambda: now[0])
    for t, done, total in [(1, 5_000, 21_893), (2, 10_000, 21_016), (3, 15_000, 20_123)]:
        now[0] = t
        p(done, total, estimated=True)
    now[0] = 4.0
    p(19_999, 19_999)  # the end: counted
    assert out.text.splitlines() == [
        "imported 5,000 of about 22,000 entries (23%), 5,000/s, ETA 0:03",
        "imported 10,000 of about 21,000 entries (48%), 5,000/s, ETA 0:02",
        "imported 15,000 of about 20,000 entries (75%), 5,000/s, ETA 0:01",
        "imported 19,999/19,999 entries (100%), 5,000/s, 0:04"]


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
    assert format_progress(stats, 50.0, eta="ETA 0:10").endswith(
        "| 50 msg/s, catching up: ETA 0:10")
    assert format_progress(stats, 50.0).endswith("| 50 msg/s")


# -- pipeline run's progress, as a log gets it: a Spark run with an injected clock ---------------


class SparkLike:
    """What the Spark engine reports once a second (as ``pipeline run`` hears it) while it
    works off a backlog in batches of ``size`` messages that take ``took`` seconds each,
    then waits for input: its stats at time ``t``."""

    def __init__(self, backlog: int, size: int, took: float, start: float = 0.0) -> None:
        self.backlog, self.size, self.took, self.start = backlog, size, took, start
        self.retries = 0

    def batches(self) -> int:
        return -(-self.backlog // self.size)

    def end(self) -> float:
        return self.start + self.batches() * self.took

    def stats(self, t: float) -> list[ProcStats]:
        k = min(self.batches(), int((t - self.start) // self.took)) if t >= self.start else 0
        done = min(self.backlog, k * self.size)
        working = self.start <= t < self.end()
        return [ProcStats(
            "m", "map", done, done, 0, k, {"in": self.backlog - done},
            # The engine once said "running" of a query waiting for input (the rate then
            # fell for as long as the graph was idle): the lag and the batch say it.
            "running", activity=f"batch {k}: {self.size:,} messages, tasks 0/1" if working else "",
            activity_s=(t - self.start) % self.took if working else 0.0, retries=self.retries)]


def run_log(job: SparkLike, until: float, on_tick=None) -> list[tuple[float, str]]:
    """The lines a log gets from ``pipeline run`` (its defaults: a report a second, a
    line at most every ten), each with the second it was written."""
    from dataspace.cli.pipeline import _Progress

    now = [0.0]
    out = Out(False)
    live = LiveLine(out, ticker=False, clock=lambda: now[0])
    show = _Progress(out, live=live, clock=lambda: now[0], gap=10.0)
    show.begin()
    lines: list[tuple[float, str]] = []
    seen = 0
    t = 0
    while t <= until:
        now[0] = float(t)
        if on_tick is not None:
            on_tick(t)
        show(job.stats(now[0]))
        live.tick()
        for x in out.text.splitlines()[seen:]:
            lines.append((now[0], x))
        seen = len(out.text.splitlines())
        t += 1
    return lines


def test_a_log_gets_a_line_every_ten_seconds_while_spark_works_and_none_while_idle():
    """Issue 28: a line every second while idle (50 in 50 s, the rate falling 2,266 ->
    368 msg/s) and every second during a batch; the ETA climbed within a batch."""
    job = SparkLike(backlog=20_000, size=5_000, took=56.0, start=5.0)  # 4 batches: 5 .. 229 s
    lines = run_log(job, until=300)
    busy = [(t, x) for t, x in lines if t < job.end()]
    idle = [(t, x) for t, x in lines if t >= job.end()]
    # While it works: one line per ten seconds (a change, or the heartbeat of a batch).
    assert 20 <= len(busy) <= job.end() / 10 + 2, "\n".join(x for _t, x in busy)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(busy)]
    assert min(gaps) >= 10, gaps
    # Idle: the line that says the work is done, then nothing for the 70 seconds after.
    assert len(idle) == 1 and idle[0][0] <= job.end() + 10, idle
    assert idle[0][1].startswith("m in 20,000 out 20,000 lag in:0 | "), idle
    # The rate: 20,000 messages in the 224 s of work (89/s), kept while idle.
    assert idle[0][1].endswith("| 89 msg/s"), idle
    # The ETA: estimating until two commits, then steady within a batch (it counts down).
    etas = [(t, x.rsplit("catching up: ", 1)[1]) for t, x in busy if "catching up: " in x]
    first = [(t, e) for t, e in etas if t < job.start + 2 * job.took]
    assert first and all(e == "estimating ETA" for _t, e in first), etas
    third = [(t, int(e[4:].split(":")[0]) * 60 + int(e.split(":")[1]))
             for t, e in etas if job.start + 2 * job.took <= t < job.start + 3 * job.took]
    assert len(third) >= 4, etas
    for (t0, e0), (t1, e1) in itertools.pairwise(third):
        assert e1 <= e0 and abs((e0 - e1) - (t1 - t0)) <= 1, third  # one second a second
    assert abs(third[0][1] - (10_000 / (5_000 / 56) - (third[0][0] - job.start - 2 * 56))) <= 2


def test_after_a_failed_task_the_eta_is_estimated_anew():
    """Right after an executor was killed the line read "259 msg/s, catching up: ETA
    12:13": the retried batch's time says nothing of the next ones."""
    job = SparkLike(backlog=30_000, size=5_000, took=20.0)

    def on_tick(t: int) -> None:
        if t == 65:  # in the fourth batch a task fails (Spark runs it again)
            job.retries = 1

    lines = run_log(job, until=130, on_tick=on_tick)
    etas = [(t, x.rsplit("catching up: ", 1)[1]) for t, x in lines if "catching up: " in x]
    assert any(e.startswith("ETA ") for t, e in etas if 40 <= t < 65), etas
    after = [e for t, e in etas if 65 <= t < 100]  # until two commits after it
    assert after and all(e == "estimating ETA" for e in after), etas
    assert any(e.startswith("ETA ") for t, e in etas if t >= 100), etas


def test_eta_counts_down_between_commits_and_is_made_again_when_overrun():
    eta = Eta()
    eta.update(0.0, 0, 100, busy=True)
    assert eta.left(0.0) is None  # nothing committed: estimating
    eta.update(10.0, 10, 90, busy=True)
    assert eta.left(10.0) is None  # one commit: the rate is not known yet
    eta.update(20.0, 20, 80, busy=True)
    assert eta.left(20.0) == 80.0  # 1/s between the commits
    eta.update(25.0, 20, 80, busy=True)
    assert eta.left(25.0) == 75.0  # within the batch: counts down
    eta.update(26.0, 20, 90, busy=True)
    assert eta.left(26.0) == 84.0  # 10 arrived: 10 s later
    eta.update(120.0, 20, 90, busy=True)  # the batch takes far longer: estimated again
    assert eta.left(120.0) == pytest.approx(90 / (10 / 110))
    eta.update(121.0, 20, 0, busy=False)
    assert eta.left(121.0) == 0.0
    eta.update(122.0, 20, 50, busy=False)  # idle: the spell is over
    eta.update(123.0, 30, 40, busy=True)
    assert eta.left(123.0) is None  # a new spell: its own commits


def test_a_status_line_in_a_log_waits_for_the_gap_and_the_last_one_is_never_lost():
    now = [0.0]
    out = Out(False)
    live = LiveLine(out, ticker=False, gap=10.0, clock=lambda: now[0])
    live.status(lambda dt: "a", key="a")
    now[0] = 1.0
    live.status(lambda dt: "b", key="b")  # within the gap: later
    now[0] = 2.0
    live.status(lambda dt: "a", key="a")  # back to what was printed: nothing to say
    now[0] = 11.0
    live.tick()
    assert out.text.splitlines() == ["a"]
    live.status(lambda dt: "c", key="c")  # the gap is over: at once
    now[0] = 12.0
    live.status(lambda dt: "d", key="d")
    now[0] = 22.0
    live.tick()  # printed by the ticker when the gap is over
    live.status(lambda dt: "e", key="e")
    live.close()  # the last change, at the end, whatever the gap
    assert out.text.splitlines() == ["a", "c", "d", "e"]


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


# -- LiveLine: phases and a status line that keeps moving; WallRate -----------------------------


def shown(raw: str) -> list[str]:
    """What a terminal shows for ``raw`` (a carriage return rewrites its line)."""
    return [x.rsplit("\r", 1)[-1].rstrip() for x in raw.split("\n") if x.rsplit("\r", 1)[-1].strip()]


def test_phases_on_a_terminal_move_while_they_last_and_stay_as_one_line_each():
    now = [0.0]
    out = Out(True)
    live = LiveLine(out, prefix="p: ", ticker=False, clock=lambda: now[0])
    live.begin("launching the JVM")
    now[0] = 3.2
    live.tick()  # the ticker: the seconds move while the JVM starts
    assert shown(out.text) == ["p: launching the JVM ... 3s"]
    now[0] = 4.1
    live.end("JVM up")
    live.begin("starting the Spark context")
    now[0] = 6.0
    live.tick()
    assert shown(out.text) == ["p: JVM up (4.1s)", "p: starting the Spark context ... 1s"]
    now[0] = 7.5
    live.end("Spark context ready")
    live.close()
    assert shown(out.text) == ["p: JVM up (4.1s)", "p: Spark context ready (3.4s)"]


def test_phases_in_a_log_are_a_line_each_and_a_long_one_says_it_is_still_going():
    now = [0.0]
    out = Out(False)
    live = LiveLine(out, prefix="p: ", ticker=False, heartbeat=10.0, clock=lambda: now[0])
    live.begin("creating the Spark session")
    for t in (5.0, 10.5, 15.0, 21.0):
        now[0] = t
        live.tick()
    now[0] = 23.0
    live.end("Spark session ready")
    assert out.text.splitlines() == ["p: creating the Spark session ... 10s",
                                     "p: creating the Spark session ... 21s",
                                     "p: Spark session ready (23.0s)"]


@pytest.mark.parametrize("tty", [True, False])
def test_a_busy_status_line_moves_on_a_terminal_and_beats_in_a_log(tty):
    now = [0.0]
    out = Out(tty)
    live = LiveLine(out, ticker=False, heartbeat=10.0, clock=lambda: now[0])
    live.status(lambda dt: f"batch 0 {hms(dt)}", key="batch 0", busy=True)
    now[0] = 4.0
    live.tick()
    now[0] = 12.0
    live.tick()
    live.status(lambda dt: f"batch 0 {hms(12 + dt)}", key="batch 0", busy=True)  # same key
    now[0] = 13.0
    live.status(lambda dt: "idle", key="idle", busy=False)
    now[0] = 30.0
    live.tick()  # not busy: nothing more
    live.close()
    if tty:
        frames = out.text.split("\r")
        assert "| batch 0 0:00" in frames[1] and "/ batch 0 0:04" in frames[2]
        assert "- batch 0 0:12" in frames[3]  # the spinner turned, the seconds moved
        assert shown(out.text) == ["idle"]
    else:  # the first, a heartbeat after ten seconds, the change; no repeat of a key
        assert out.text.splitlines() == ["batch 0 0:00", "batch 0 0:12", "idle"]


def test_a_notice_is_written_at_once_past_the_buffer():
    """What a signal handler says ("stopping ...") must not wait for a buffer, nor take a
    lock the interrupted code may hold: it is one raw write."""
    r, w = os.pipe()
    with open(r, "rb") as rf, open(w, "w", buffering=1 << 16) as wf:
        live = LiveLine(wf, ticker=False)
        wf.write("buffered, not flushed")
        live.notice("stopping ...")
        assert os.read(rf.fileno(), 100) == b"stopping ...\n"


def test_the_ticker_thread_keeps_a_terminal_line_moving_and_stops_with_close():
    class Watched(Out):
        def __init__(self) -> None:
            super().__init__(True)
            self.cond = threading.Condition()

        def write(self, s: str) -> None:
            with self.cond:
                super().write(s)
                self.cond.notify_all()

    out = Watched()
    live = LiveLine(out, tick=0.01)
    live.begin("waiting")  # one draw; the ticker draws the others on its own
    with out.cond:
        assert out.cond.wait_for(lambda: out.text.count("\r") >= 3, 30.0)
    live.close()
    assert live._thread is not None and not live._thread.is_alive()


def test_a_rate_over_wall_time_divides_a_burst_by_the_time_its_work_took():
    """A micro-batch of a minute commits its 5,000 messages at once: 89/s (the truth),
    not 5,000 in the tick it landed (13,989 msg/s was once shown for about 89)."""
    r = WallRate(window=30.0)
    for t in range(0, 57):
        r.add(float(t), 0 if t < 56 else 5000, busy=True)
    assert round(r.rate()) == 89
    for t in range(57, 81):  # the next batch runs: the rate decays honestly
        r.add(float(t), 5000, busy=True)
    assert round(r.rate()) == 62  # 5,000 in 80 s
    for t in range(81, 113):
        r.add(float(t), 5000 if t < 112 else 10000, busy=True)
    assert round(r.rate()) == 89  # the second batch over its own 56 s
    r.add(113.0, 10000, busy=False)
    r.add(500.0, 10000, busy=False)
    assert round(r.rate()) == 89  # idle time after the work does not count
    # A steady stream: the last window's messages over the window.
    r = WallRate(window=10.0)
    for t in range(100):
        r.add(t / 2, t * 100, busy=True)
    assert round(r.rate()) == 200
    # Work done between two samples (too fast to be seen busy) still has a rate.
    r = WallRate()
    r.add(0.0, 0, busy=False)
    assert r.rate() is None
    r.add(1.0, 7, busy=False)
    assert r.rate() == 7.0
