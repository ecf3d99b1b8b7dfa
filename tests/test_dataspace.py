"""The in-process Dataspace API."""

from __future__ import annotations

import logging

import pytest

from dataspace import Dataspace, Entity
from dataspace.pattern import from_preserves, parse_pattern, to_preserves
from dataspace.values import Embedded, Record, Sequence, Symbol, parse


def p(text):
    return parse(text)


class Log:
    def __init__(self):
        self.items = []

    def add(self, tag):
        return lambda *caps: self.items.append((tag, *caps))

    def take(self):
        out, self.items = self.items, []
        return out


def test_assert_retract_send_observe():
    ds, log = Dataspace(), Log()
    ds.observe("<Says $who $what>", on_assert=log.add("+"), on_retract=log.add("-"),
               on_message=log.add("!"))
    h = ds.assert_(p('<Says "alice" "hi">'))
    ds.send(p('<Says "bob" "yo">'))
    ds.retract(h)
    assert log.take() == [("+", "alice", "hi"), ("!", "bob", "yo"), ("-", "alice", "hi")]


def test_late_joiner_sees_current_state_at_once():
    ds, log = Dataspace(), Log()
    ds.assert_(p('<Present "alice">'))
    ds.assert_(p('<Present "bob">'))
    ds.observe("<Present $who>", on_assert=log.add("+"))
    assert sorted(log.take()) == [("+", "alice"), ("+", "bob")]


def test_bag_semantics_through_handles():
    ds, log = Dataspace(), Log()
    ds.observe("<Present $who>", on_assert=log.add("+"), on_retract=log.add("-"))
    h1 = ds.assert_(p('<Present "alice">'))
    h2 = ds.assert_(p('<Present "alice">'))
    assert ds.count(p('<Present "alice">')) == 2
    assert ds.retract(h1) is True
    assert ds.retract(h1) is False  # retracting twice is harmless
    assert log.take() == [("+", "alice")]
    ds.retract(h2)
    assert log.take() == [("-", "alice")]
    assert p('<Present "alice">') not in ds


def test_cancelled_subscription_hears_nothing_more():
    ds, log = Dataspace(), Log()
    sub = ds.observe("<Present $who>", on_assert=log.add("+"), on_retract=log.add("-"),
                     on_message=log.add("!"))
    h = ds.assert_(p('<Present "alice">'))
    sub.cancel()
    ds.retract(h)
    ds.send(p('<Present "bob">'))
    assert log.take() == [("+", "alice")]
    assert not any(isinstance(a, Record) and a.label == Symbol("Observe") for a in ds.assertions())


def test_turn_applies_additions_before_removals_glitch_free():
    # Seed 000's glitch example: replace [3] with [4] atomically; a [_] observer never
    # sees an empty dataspace, and an observer of the element sees 4 appear before 3 goes.
    ds = Dataspace()
    any_log, elem_log = Log(), Log()
    ds.observe("[_]", on_assert=any_log.add("+"), on_retract=any_log.add("-"))
    ds.observe("[$x]", on_assert=elem_log.add("+"), on_retract=elem_log.add("-"))
    h3 = ds.assert_(p("[3]"))
    assert any_log.take() == [("+",)]
    with ds.turn():
        ds.retract(h3)
        ds.assert_(p("[4]"))
    assert any_log.take() == []  # no glitch
    assert elem_log.take() == [("+", 3), ("+", 4), ("-", 3)]


def test_turn_is_atomic_and_cancels_intra_turn_pairs():
    ds, log = Dataspace(), Log()
    ds.observe("<a $x>", on_assert=log.add("+"), on_retract=log.add("-"), on_message=log.add("!"))
    with ds.turn():
        h = ds.assert_(p("<a 1>"))
        ds.send(p("<a 2>"))
        ds.retract(h)
        ds.assert_(p("<a 3>"))
        assert log.take() == []  # nothing is applied before the turn ends
    assert log.take() == [("+", 3), ("!", 2)]


def test_turn_that_raises_is_discarded():
    ds = Dataspace()
    h = ds.assert_(p("<keep>"))
    with pytest.raises(ZeroDivisionError), ds.turn():
        ds.assert_(p("<never>"))
        ds.retract(h)
        1 / 0  # noqa: B018
    assert p("<never>") not in ds
    assert p("<keep>") in ds
    ds.retract(h)
    assert p("<keep>") not in ds


def test_callbacks_can_act_and_run_in_order():
    ds, log = Dataspace(), Log()

    def echo(who, text):
        ds.send(Record(Symbol("Echo"), [who, text]))

    ds.observe("<Says $who $text>", on_message=echo)
    ds.observe("<Echo $who $text>", on_message=log.add("echo"))
    ds.send(p('<Says "a" "1">'))
    ds.send(p('<Says "b" "2">'))
    assert log.take() == [("echo", "a", "1"), ("echo", "b", "2")]


def test_a_raising_callback_is_logged_and_isolated(caplog):
    ds, log = Dataspace(), Log()

    def bad(x):
        ds.assert_(p("<from-bad>"))  # discarded with the failed callback
        raise RuntimeError("boom")

    ds.observe("<a $x>", on_assert=bad)
    ds.observe("<a $x>", on_assert=log.add("good"))
    with caplog.at_level(logging.ERROR, logger="dataspace.dataspace"):
        ds.assert_(p("<a 1>"))
    assert log.take() == [("good", 1)]
    assert "boom" in caplog.text
    assert p("<from-bad>") not in ds
    ds.assert_(p("<a 2>"))  # the dataspace carries on
    assert log.take() == [("good", 2)]


def test_during_tears_down_what_setup_did():
    ds, log = Dataspace(), Log()

    def user_present(who):
        ds.assert_(Record(Symbol("Greeting"), [who]))
        ds.observe(f'<Says "{who}" $text>', on_message=log.add(f"msg:{who}"))
        return lambda: log.items.append(("cleanup", who))

    ds.during("<Present $who>", user_present)
    ds.observe("<Greeting $who>", on_assert=log.add("greet+"), on_retract=log.add("greet-"))
    h = ds.assert_(p('<Present "alice">'))
    ds.send(p('<Says "alice" "hi">'))
    assert log.take() == [("greet+", "alice"), ("msg:alice", "hi")]
    ds.retract(h)
    ds.send(p('<Says "alice" "hello?">'))
    assert log.take() == [("cleanup", "alice"), ("greet-", "alice")]


def test_during_once_per_distinct_capture_and_nested():
    ds, log = Dataspace(), Log()

    def room(r):
        log.items.append(("room", r))
        ds.during(f'<Member "{r}" $who>', lambda who: log.items.append(("member", r, who))
                  or (lambda: log.items.append(("left", r, who))))

    ds.during("<Room $r>", room)
    room_h1 = ds.assert_(p('<Room "x">'))
    room_h2 = ds.assert_(p('<Room "x">'))
    m = ds.assert_(p('<Member "x" "ann">'))
    assert log.take() == [("room", "x"), ("member", "x", "ann")]
    ds.retract(room_h1)
    assert log.take() == []
    ds.retract(room_h2)  # the room goes: its nested during facet ends too
    assert log.take() == [("left", "x", "ann")]
    ds.retract(m)
    assert log.take() == []


def test_subscriptions_are_observable_assertions():
    ds, log = Dataspace(), Log()
    # A producer learns who wants <Says "alice" _> and starts producing on demand.
    ds.during(
        '<Observe <group <rec Says> {0: <lit $who>}> _>',
        lambda who: log.items.append(("interest", who)) or (lambda: log.items.append(("gone", who))),
    )
    sub = ds.observe('<Says "alice" $text>', on_message=log.add("msg"))
    assert log.take() == [("interest", "alice")]
    # The Observe assertion carries the wire form of the pattern and the observer.
    obs = [a for a in ds.assertions() if isinstance(a, Record) and a.label == Symbol("Observe")]
    wanted = [from_preserves(a.fields[0]) for a in obs if isinstance(a.fields[1].value, type(sub))]
    assert parse_pattern('<Says "alice" $text>') in wanted
    sub.cancel()
    assert log.take() == [("gone", "alice")]


def test_foreign_entity_observer_gets_captures_as_sequences():
    class Collector(Entity):
        def __init__(self):
            self.events = []
            self.handles = {}

        def on_assert(self, value, handle):
            self.handles[handle] = value
            self.events.append(("+", value))

        def on_retract(self, handle):
            self.events.append(("-", self.handles.pop(handle)))

        def on_message(self, value):
            self.events.append(("!", value))

    ds, c = Dataspace(), Collector()
    ds.assert_(p('<Says "a" "b">'))
    obs = ds.assert_(Record(Symbol("Observe"), [to_preserves(parse_pattern("<Says $ $>")), Embedded(c)]))
    h = ds.assert_(p('<Says "c" "d">'))
    ds.send(p('<Says "e" "f">'))
    ds.retract(h)
    assert c.events == [
        ("+", Sequence(["a", "b"])),
        ("+", Sequence(["c", "d"])),
        ("!", Sequence(["e", "f"])),
        ("-", Sequence(["c", "d"])),
    ]
    ds.retract(obs)  # the observer goes: it is told its assertions are gone
    assert c.events[-1] == ("-", Sequence(["a", "b"])) and not c.handles


def test_malformed_observe_is_plain_data(caplog):
    ds = Dataspace()
    with caplog.at_level(logging.WARNING):
        ds.assert_(Record(Symbol("Observe"), [Symbol("nonsense"), Embedded(object())]))
    assert "malformed pattern" in caplog.text


def test_values_are_normalised_and_confusable_atoms_stay_distinct():
    ds, log = Dataspace(), Log()
    ds.observe("[$x]", on_assert=log.add("+"))
    ds.assert_([1])
    ds.assert_([1.0])
    ds.assert_([True])
    ds.assert_((1,))  # same as [1]
    assert [type(x) for _t, x in log.take()] == [int, float, bool]
    assert ds.count([1]) == 2


def test_handles_of_another_dataspace_do_nothing():
    a, b = Dataspace(), Dataspace()
    h = a.assert_(1)
    assert b.retract(h) is False
    assert 1 in a and a.value_of(h) == 1
    with pytest.raises(TypeError, match="takes a Handle"):
        b.retract("nonsense")


def test_handles_are_not_tracked_by_the_garbage_collector():
    import gc

    h = Dataspace().assert_(1)
    assert isinstance(h, int) and not gc.is_tracked(h)


def test_during_keeps_confusable_captures_apart():
    # (1,) and (True,) are equal Python tuples: facets are keyed by Sequence instead.
    ds, log = Dataspace(), Log()
    ds.during("[$x]", lambda x: log.items.append(("start", x))
              or (lambda: log.items.append(("stop", x))))
    h1 = ds.assert_([1])
    ds.assert_([True])
    ds.retract(h1)
    got = [(e, type(x)) for e, x in log.take()]
    assert got == [("start", int), ("start", bool), ("stop", int)]


def test_message_tap_hears_each_turn_once_in_order_after_its_deliveries():
    ds = Dataspace()
    ds.max_turn_events = 1000  # the server's metered path
    log = Log()
    ds.observe("<Says $who $text>", on_message=log.add("obs"))
    ds.tap_messages(lambda msgs: log.items.append(("tap", *msgs)))
    with ds.turn():
        ds.assert_(p('<Present "a">'))
        ds.send(p('<Says "a" "1">'))
        ds.send(p('<Other>'))  # nothing observes it: the tap hears it all the same
        ds.send(p('<Says "a" "2">'))
    assert log.take() == [("obs", "a", "1"), ("obs", "a", "2"),
                          ("tap", p('<Says "a" "1">'), p("<Other>"), p('<Says "a" "2">'))]
    ds.send(p('<Says "b" "3">'))  # outside a turn: a turn of its own
    ds.max_turn_events = None
    ds.send(p('<Says "c" "4">'))
    assert log.take() == [("obs", "b", "3"), ("tap", p('<Says "b" "3">')),
                          ("obs", "c", "4"), ("tap", p('<Says "c" "4">'))]
    ds.tap_messages(None)
    ds.send(p('<Says "d" "5">'))
    assert log.take() == [("obs", "d", "5")]


def test_a_message_sent_by_a_callback_reaches_the_tap_after_the_one_that_caused_it():
    ds = Dataspace()
    seen = []
    ds.observe("<Ping $n>", on_message=lambda n: ds.send(p(f"<Pong {n}>")))
    ds.tap_messages(lambda msgs: seen.append(list(msgs)))
    with ds.turn():
        ds.send(p("<Ping 1>"))
        ds.send(p("<Ping 2>"))
    assert seen == [[p("<Ping 1>"), p("<Ping 2>")], [p("<Pong 1>")], [p("<Pong 2>")]]


def test_hidden_observer_without_on_message_is_not_matched_by_messages():
    ds = Dataspace()
    log = Log()
    ds.observe_hidden("$v", on_assert=log.add("+"), on_retract=log.add("-"))
    h = ds.assert_(p('<Present "a">'))
    ds.send(p('<Says "a" "hi">'))
    ds.retract(h)
    assert log.take() == [("+", p('<Present "a">')), ("-", p('<Present "a">'))]
    fire: list = []
    ds.index.sink, sink = fire, ds.index.sink
    try:
        ds.index.send_message(p('<Says "a" "hi">'))
    finally:
        ds.index.sink = sink
    assert fire == []  # no delivery queued at all: messages cost such an observer nothing
    assert not ds.index.root.cont.has_msg  # not even a visit of its node
    sub = ds.observe_hidden("$v", on_message=log.add("!"))
    assert ds.index.root.cont.has_msg
    ds.send(p("<x>"))
    assert log.take() == [("!", p("<x>"))]
    sub.cancel()
    assert not ds.index.root.cont.has_msg
