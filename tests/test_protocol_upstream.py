"""Seed 001's machines over patterns, without sockets or clocks.

The property tests connect a Subscriber and a Producer through channels that lose,
duplicate and reorder what they carry, in simulated time, drive them with random
subscribe / unsubscribe / publish sequences, and check the seed's claims:

* the producer's trie converges to the subscriber's canonical set (nothing else left:
  no negative, no root artifact) once the channel lets requests through;
* no wanted message is dropped by the producer once its subscription is synchronized;
* in the seed's lazy mode, a producer message causes at most one subscription request.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dataspace.pattern import match, parse_pattern
from dataspace.protocol.upstream import (
    CANONICAL,
    POSITIVE,
    SYNCHRONIZED,
    Producer,
    Subscriber,
    UpstreamError,
    chain_from_value,
    chain_key,
    chain_matches,
    chain_to_value,
    pattern_chain,
    value_chain,
)
from dataspace.values import Record, Symbol, parse
from strategies import values

PATTERNS = [parse_pattern(t) for t in (
    '<Says "alice" $text>', '<Says "bob" $text>', "<Says $who $text>", '<Says $who "hi">',
    "<Present $who>", '<Present "carol">', "$x", "[1 $x]", "<Order $id <item $n _>>",
    '<Order 7 <item "pen" _>>', "{k: $v}",
)]
VALUES = [parse(t) for t in (
    '<Says "alice" "hi">', '<Says "bob" "yo">', '<Says "carol" "hi">', '<Present "carol">',
    '<Present "dave">', "[1 2]", "[2 1]", '<Order 7 <item "pen" 3>>', '<Order 8 <item "ink" 1>>',
    "{k: 1}", "<Junk>", '"a string"', "42",
)]


# -- chains ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PATTERNS), values)
def test_a_patterns_chain_matches_whatever_the_pattern_matches(p, v):
    if match(p, v) is not None:
        assert chain_matches(pattern_chain(p), v)


@settings(max_examples=200, deadline=None)
@given(values)
def test_a_values_own_chain_matches_it_and_survives_the_wire(v):
    c = value_chain(v)
    assert chain_matches(c, v)
    assert chain_key(chain_from_value(chain_to_value(c))) == chain_key(c)


@pytest.mark.parametrize("bad", [
    "7", "[[1 2 3]]", '[[[-1] <arr>]]', "[[[] <rec>]]", "[[[] <lit [1]>]]", "[[[] <odd 1>]]",
    "[" + " ".join(["[[] <arr>]"] * 65) + "]", "[[[" + " ".join(["0"] * 33) + "] <arr>]]",
    '[[[0] <lit 1>]]', '[[[] <rec a>] [[0 1] <lit 1>]]',  # the value holding it comes first
])
def test_malformed_chains_are_refused(bad):
    with pytest.raises(UpstreamError):
        chain_from_value(parse(bad))


def test_prefixes_are_what_a_pattern_fixes_in_visit_order():
    assert len(pattern_chain(parse_pattern('<Says "alice" $text>'))) == 2
    assert len(pattern_chain(parse_pattern('<Says $who "hi">'))) == 1   # stops at $who
    assert pattern_chain(parse_pattern("$x")) == ()
    assert len(pattern_chain(parse_pattern("<a <b 1> 2>"))) == 4
    # 1, 1.0 and #t are different atoms here too
    assert chain_key(value_chain(parse("1"))) != chain_key(value_chain(parse("1.0")))


# -- the machines through a bad channel ----------------------------------------------------


class Channel:
    """Loses, duplicates and delays (so reorders) what it carries."""

    def __init__(self, rnd: random.Random, loss: float, dup: float, delay: float) -> None:
        self.rnd, self.loss, self.dup, self.delay = rnd, loss, dup, delay
        self.q: list[tuple[float, int, object]] = []
        self.n = 0

    def send(self, msg: object, now: float) -> None:
        copies = 0 if self.rnd.random() < self.loss else 1
        if copies and self.rnd.random() < self.dup:
            copies = 2
        for _ in range(copies):
            self.n += 1
            self.q.append((now + self.rnd.uniform(0, self.delay), self.n, msg))

    def due(self, now: float) -> list[object]:
        self.q.sort()
        out = [m for t, _n, m in self.q if t <= now]
        self.q = [x for x in self.q if x[0] > now]
        return out


class Link:
    def __init__(self, rnd: random.Random, eager: bool, loss: float, dup: float, delay: float,
                 window: int = 1000):
        self.s = Subscriber(eager=eager, rto=0.1, rto_max=1.0, window=window)
        self.p = Producer()
        self.up = Channel(rnd, loss, dup, delay)     # requests
        self.down = Channel(rnd, loss, dup, delay)   # confirms and data
        self.now = 0.0
        self.interest: dict[int, int] = {}           # pattern index -> count
        self.wanted_dropped: list[object] = []
        self.per_message: list[int] = []

    def flush(self) -> None:
        for m in self.s.take_outgoing():
            self.up.send(m, self.now)
        for m in self.p.take_outgoing():
            self.down.send(("confirm", m), self.now)

    def step(self, dt: float) -> None:
        self.now += dt
        for m in self.up.due(self.now):
            self.p.on_request(m)
        for kind, m in self.down.due(self.now):
            if kind == "confirm":
                self.s.on_confirm(m, self.now)
            else:
                before = self.s.stats.requests_sent
                self.s.received(m, self.now)
                self.per_message.append(self.s.stats.requests_sent - before)
        self.s.tick(self.now)
        self.flush()

    def subscribe(self, i: int) -> None:
        self.interest[i] = self.interest.get(i, 0) + 1
        self.s.add_interest(pattern_chain(PATTERNS[i]))
        self.flush()

    def unsubscribe(self, i: int) -> None:
        if self.interest.get(i):
            self.interest[i] -= 1
            self.s.remove_interest(pattern_chain(PATTERNS[i]))
            self.flush()

    def publish(self, v) -> None:
        wanted = any(n and match(PATTERNS[i], v) is not None for i, n in self.interest.items())
        forwarded = self.p.forward(v)
        if wanted and not forwarded and self.synchronized_for(v):
            self.wanted_dropped.append(v)
        if forwarded:
            self.down.send(("data", v), self.now)

    def synchronized_for(self, v) -> bool:
        """The subscriber holds a SUBSCRIBED canonical entry for ``v`` and no negative."""
        ok = False
        for chain, flags, canon in self.s.entries():
            if not chain_matches(chain, v):
                continue
            if canon and flags & POSITIVE and flags & SYNCHRONIZED and flags & CANONICAL:
                ok = True
            if not flags & POSITIVE:
                return False
        return ok


OPS = st.lists(st.one_of(
    st.tuples(st.just("sub"), st.integers(0, len(PATTERNS) - 1)),
    st.tuples(st.just("unsub"), st.integers(0, len(PATTERNS) - 1)),
    st.tuples(st.just("pub"), st.integers(0, len(VALUES) - 1)),
    st.tuples(st.just("wait"), st.floats(0.0, 0.5)),
), max_size=60)


def run(ops, seed, eager, loss, dup, delay, window=1000) -> Link:
    link = Link(random.Random(seed), eager, loss, dup, delay, window)
    link.s.start(0.0)
    link.flush()
    for op, arg in ops:
        if op == "sub":
            link.subscribe(arg)
        elif op == "unsub":
            link.unsubscribe(arg)
        elif op == "pub":
            link.publish(VALUES[arg])
        link.step(arg if op == "wait" else 0.01)
    return link


@settings(max_examples=400, deadline=None)
@given(OPS, st.integers(0, 1 << 30), st.sampled_from([0.0, 0.2, 0.5]),
       st.sampled_from([0.0, 0.3]), st.sampled_from([0.0, 0.3]), st.sampled_from([1000, 1, 2]))
# Reordered requests: a reset entry buried after its ancestor was pruned with it.
@example([("sub", 0), ("sub", 1)] + [("sub", 0)] * 10
         + [("sub", 5), ("sub", 6), ("unsub", 5), ("unsub", 6), ("sub", 5), ("unsub", 5)],
         0, 0.0, 0.0, 0.3, 1000)
def test_eager_producer_converges_to_the_canonical_set(ops, seed, loss, dup, delay, window):
    link = run(ops, seed, True, loss, dup, delay, window)
    # From now on nothing is lost (duplicates and reordering go on): within bounded
    # simulated time every request is confirmed and the tries agree.
    link.up.loss = link.down.loss = 0.0
    for _ in range(2000):
        link.step(0.05)
        if not link.s.summary().pending and not link.up.q and not link.down.q:
            break
    assert not link.s.summary().pending
    assert link.p.positive_chains() == link.s.canonical()
    assert all(positive for _c, positive in link.p.entries()), "a negative entry is left"
    # and the root artifact is gone (unless everything is wanted)
    root_wanted = chain_key(()) in link.s.canonical()
    assert (chain_key(()) in link.p.positive_chains(include_artifact=True)) == root_wanted
    # Wanted messages published now all cross; unwanted ones do not.
    for v in VALUES:
        wanted = any(n and match(PATTERNS[i], v) is not None for i, n in link.interest.items())
        if wanted:
            assert link.p.forward(v), v
    assert link.wanted_dropped == []


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(0, 1 << 30), st.sampled_from([0.0, 0.3]), st.sampled_from([0.0, 0.3]))
def test_lazy_mode_one_request_per_producer_message_and_no_wanted_loss(ops, seed, loss, dup):
    link = run(ops, seed, False, loss, dup, 0.2)
    assert all(n <= 1 for n in link.per_message), link.per_message
    assert link.wanted_dropped == []


def test_the_seeds_walk_through_a_subscription():
    """A new session forwards messages under the root artifact; a subscription is
    confirmed; the root artifact is then RESET; only what is wanted crosses."""
    s, p = Subscriber(), Producer()
    s.start(0.0)
    assert [m.label.name for m in s.take_outgoing()] == ["reset"]  # nothing wanted yet
    p.start()
    assert p.forward(parse('<Junk>'))          # root artifact: messages flow
    assert not p.forward(parse('<Junk>'), assertion=True)  # never assertions
    s2, p = Subscriber(), Producer()
    s2.add_interest(pattern_chain(parse_pattern('<Says "alice" $t>')))
    s2.start(0.0)  # a session starts with interest already there
    out = s2.take_outgoing()
    assert [m.label.name for m in out] == ["subscribe"]  # one round: one request each
    for m in out:
        p.on_request(m)
    assert p.forward(parse('<Junk>'))  # still the root artifact
    for c in p.take_outgoing():
        s2.on_confirm(c, 0.0)
    reset = s2.take_outgoing()
    assert [m.label.name for m in reset] == ["reset"] and reset[0].fields[2] == chain_to_value(())
    for m in reset:
        p.on_request(m)
    for c in p.take_outgoing():
        s2.on_confirm(c, 0.0)
    assert p.forward(parse('<Says "alice" "hi">'))
    assert not p.forward(parse('<Says "bob" "hi">'))
    assert not p.forward(parse('<Junk>'))
    assert s2.summary().subscribed == 1 and s2.summary().pending == 0


def test_a_stray_message_is_rejected_then_the_negative_goes():
    s, p = Subscriber(), Producer()
    s.add_interest(pattern_chain(parse_pattern('<Says "alice" $t>')))
    for _ in range(4):  # settle: subscribe, confirm, reset root, confirm
        for m in s.take_outgoing():
            p.on_request(m)
        for c in p.take_outgoing():
            s.on_confirm(c, 0.0)
    assert not s.received(parse("<Junk 1>"), 1.0)  # forwarded by a stale producer
    (rej,) = s.take_outgoing()
    assert rej.label == Symbol("reject")
    p.on_request(rej)
    (conf,) = p.take_outgoing()
    s.on_confirm(conf, 1.0)
    (reset,) = s.take_outgoing()
    assert reset.label == Symbol("reset")


@pytest.mark.parametrize("bad", [
    "<confirm subscribe>", "<confirm subscribe 1 []>", "<confirm odd 1>", '<confirm subscribe "x">',
    "<hello>",
])
def test_bad_confirms_are_refused(bad):
    with pytest.raises(UpstreamError):
        Subscriber().on_confirm(parse(bad), 0.0)


@pytest.mark.parametrize("bad", [
    "<subscribe 1 0>", "<subscribe x 0 []>", "<frob 1 0 []>", "<reset 1 0 [[[] <nope>]]>",
])
def test_bad_requests_are_refused(bad):
    with pytest.raises(UpstreamError):
        Producer().on_request(parse(bad))


def test_the_producer_trie_is_bounded():
    p = Producer(max_entries=5)
    with pytest.raises(UpstreamError, match="too many"):
        for i in range(10):
            p.on_request(Record(Symbol("subscribe"), [i, 0, chain_to_value(
                pattern_chain(parse_pattern(f"<n {i}>")))]))


# -- retransmission ----------------------------------------------------------------------


def chains(n: int) -> list:
    return [pattern_chain(parse_pattern(f'<Says "user-{i}" $t>')) for i in range(n)]


def test_a_request_is_stamped_with_the_time_it_was_made():
    # A link idle since t=0: a subscription made at t=100 is due for resending at 101,
    # not at once (it used to carry the last time seen, and went out twice).
    s = Subscriber(rto=1.0, rto_max=10.0)
    p = Producer()
    s.start(0.0)
    for m in s.take_outgoing():  # the root artifact's reset: nothing is wanted yet
        p.on_request(m)
    for m in p.take_outgoing():
        s.on_confirm(m, 0.1)
    assert s.next_deadline() is None
    (c,) = chains(1)
    s.add_interest(c, 100.0)
    assert len(s.take_outgoing()) == 1
    assert s.next_deadline() == pytest.approx(101.0)
    s.tick(100.5)
    assert s.take_outgoing() == [] and s.stats.retransmissions == 0
    s.remove_interest(c, 200.0)  # unconfirmed still: the reset replaces the subscribe
    assert [m.label for m in s.take_outgoing()] == [Symbol("reset")]
    s.tick(200.5)
    assert s.take_outgoing() == [] and s.stats.retransmissions == 0
    s.tick(201.0)
    assert [m.label for m in s.take_outgoing()] == [Symbol("reset")]
    assert s.stats.retransmissions == 1


def test_every_request_counted_is_a_request_sent():
    # What the link does when it connects: a new session, then the interest it has.
    s = Subscriber()
    s.start(0.0)
    for c in chains(3):
        s.add_interest(c, 0.0)
    s.start(1.0)  # and a reconnection before anything was taken
    assert s.stats.requests_sent == len(s.take_outgoing()) == 3


def test_a_backlog_being_confirmed_is_not_resent():
    # A reconnection subscribes 2,000 chains at once; the producer confirms 100 every
    # 0.1 s, so the last confirm comes 2 s later, well after the 1 s timeout.  While
    # confirms keep coming nothing is resent (TCP's rule: an ACK of new data restarts
    # the timer); the producer ends up with exactly one request per chain.
    s = Subscriber(rto=1.0, rto_max=10.0)
    p = Producer()
    s.start(0.0)
    for c in chains(2000):
        s.add_interest(c, 0.0)
    backlog = list(s.take_outgoing())
    now = 0.0
    for _ in range(200):
        if not backlog:
            break
        now += 0.1
        batch, backlog = backlog[:100], backlog[100:]
        for m in batch:
            p.on_request(m)
        for m in p.take_outgoing():
            s.on_confirm(m, now)
        s.tick(now)
        backlog += s.take_outgoing()
    assert p.requests == 2000 + 1  # each subscription once, and the root artifact's reset
    assert s.stats.retransmissions == 0
    assert not s.summary().pending


def test_a_lost_request_is_resent_even_while_others_are_confirmed():
    # Progress elsewhere delays a resend, but never beyond rto_max past its deadline.
    s = Subscriber(rto=1.0, rto_max=5.0)
    p = Producer()
    s.start(0.0)
    lost, *others = chains(200)
    s.add_interest(lost, 0.0)
    s.take_outgoing()  # lost on the way
    now, resent = 0.0, None
    for c in others:
        now += 0.1
        s.add_interest(c, now)
        for m in s.take_outgoing():
            if m.fields[2] == chain_to_value(lost):
                resent = now
                break
            p.on_request(m)
        if resent is not None:
            break
        for m in p.take_outgoing():
            s.on_confirm(m, now)
        s.tick(now)
    assert resent is not None and 1.0 + 5.0 <= resent <= 1.0 + 5.0 + 0.2


# -- the producer's decision, differential ----------------------------------------------------


CHAINS = [pattern_chain(p) for p in PATTERNS] + [value_chain(v)[:k] for v in VALUES for k in (1, 2, 3)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["subscribe", "reject", "reset"]),
                          st.integers(0, len(CHAINS) - 1)), max_size=30),
       st.lists(values, max_size=10))
def test_the_producers_one_walk_decides_as_its_definition(requests, extra):
    # forward() is a single walk that stops at the first good entry; forward_reference()
    # is the rule as written (every matching entry, then a search for negatives below).
    p = Producer()
    for seq, (kind, i) in enumerate(requests):
        p.on_request(Record(Symbol(kind), [seq, 0, chain_to_value(CHAINS[i])]))
    for v in [*VALUES, *extra]:
        for assertion in (False, True):
            assert p.forward(v, assertion) == p.forward_reference(v, assertion), (v, p.entries())


def test_at_most_a_window_of_requests_is_in_flight():
    # Slow start: 32 requests first, one more per request confirmed, never over the window.
    s = Subscriber(window=100)
    p = Producer()
    s.start(0.0)
    for c in chains(250):
        s.add_interest(c, 0.0)
    out = s.take_outgoing()
    assert len(out) == Subscriber.INITIAL_WINDOW and s.summary().pending == 251  # + root reset
    now, in_flight, most = 0.0, len(out), len(out)
    for _ in range(100):
        if not out:
            break
        now += 0.01
        for m in out:
            p.on_request(m)
        for m in p.take_outgoing():
            s.on_confirm(m, now)
            in_flight -= 1
        out = s.take_outgoing()
        in_flight += len(out)
        most = max(most, in_flight)
    assert most == 100 and in_flight == 0 and not s.summary().pending
    assert s.stats.requests_sent == 251 and s.stats.retransmissions == 0


def test_the_timeout_follows_the_round_trips():
    # A producer 3 s away (3x the initial timeout): the first requests are resent, the
    # timer backs off, and once a round trip is measured the timeout covers it -- the
    # later requests go out once each.
    s = Subscriber(rto=1.0, rto_max=30.0)
    p = Producer()
    s.start(0.0)
    wire: list = []  # (arrival time, request)
    answers: list = []  # (arrival time, confirm)
    now = 0.0
    for i, c in enumerate(chains(40)):
        s.add_interest(c, now)
        for _ in range(10):  # 1 s in steps of 0.1
            now = round(now + 0.1, 6)
            s.tick(now)
            wire += [(now + 1.5, m) for m in s.take_outgoing()]
            for t, m in [x for x in wire if x[0] <= now]:
                p.on_request(m)
                answers += [(t + 1.5, a) for a in p.take_outgoing()]
            wire = [x for x in wire if x[0] > now]
            for _t, a in [x for x in answers if x[0] <= now]:
                s.on_confirm(a, now)
            answers = [x for x in answers if x[0] > now]
        if i == 20:
            before = s.stats.retransmissions
    assert 3.0 <= s.timeout < 8.0
    assert before > 0 and s.stats.retransmissions == before  # none in the last 20 s


def test_a_new_session_starts_with_a_small_window_again():
    # A reconnection's round of 500 goes out 32 at a time at first, however wide the
    # window had grown before the cut.
    s = Subscriber(window=1000)
    p = Producer()
    s.start(0.0)
    for c in chains(500):
        s.add_interest(c, 0.0)
    for _ in range(100):
        out = s.take_outgoing()
        if not out:
            break
        for m in out:
            p.on_request(m)
        for m in p.take_outgoing():
            s.on_confirm(m, 0.01)
    assert not s.summary().pending
    s.start(1.0)
    assert len(s.take_outgoing()) == Subscriber.INITIAL_WINDOW
