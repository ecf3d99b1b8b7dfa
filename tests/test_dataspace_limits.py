"""Per-turn delivery limits (``Dataspace.max_turn_events``) and the cost of observers going.

The differential test drives a metered dataspace with a small limit and an unmetered
reference through the same random turns: a refused turn (TurnTooLarge) must leave no
trace at all -- same assertions, same events heard by every observer -- and an accepted
one must behave exactly as in the reference.  Each observer's own sequence of events is
compared, turn by turn; the interleaving of events between different observers is not
promised (an observer reinstalled by a rollback may be handed its events after the
others), nor the order of the assertions one turn tells an observer of.
"""

from __future__ import annotations

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from dataspace import Dataspace, Entity
from dataspace.dataspace import TurnTooLarge
from dataspace.pattern import parse_pattern, to_preserves
from dataspace.values import Embedded, Record, Symbol, parse, stringify

PATTERNS = [to_preserves(parse_pattern(t)) for t in ("$x", "<a $x>", "<b _>", "<Observe $p _>")]
VALUES = [parse(t) for t in ("<a 1>", "<a 2>", "<b 1>", "<b 2>", "<c>")]


class Recorder(Entity):
    """An observer entity that logs what it hears, retractions by the value retracted."""

    def __init__(self, log: list, name: int, show) -> None:
        self.log = log
        self.name = name
        self.show = show
        self.held: dict[int, str] = {}

    def on_assert(self, value, handle):
        self.held[handle] = self.show(value)
        self.log.append((self.name, "+", self.held[handle]))

    def on_retract(self, handle):
        self.log.append((self.name, "-", self.held.pop(handle)))

    def on_message(self, value):
        self.log.append((self.name, "!", self.show(value)))


def heard(side: Side) -> dict:
    """What each observer heard, turn by turn: the assertions and retractions of a turn
    as a set (a set of values has no order: an observer installed mid-turn, or a value
    re-added by a rollback, may be told of them in another order) and its messages in
    the order they were sent."""
    out: dict = {}
    cuts = [*side.cuts, len(side.log)]
    start = 0
    for turn, end in enumerate(cuts):
        per: dict = {}
        for name, kind, text in side.log[start:end]:
            per.setdefault(name, ([], []))[kind == "!"].append((kind, text))
        for name, (changes, messages) in per.items():
            out.setdefault(name, []).append((turn, sorted(changes), messages))
        start = end
    return out


class Side:
    """One dataspace, its observer entities, a subscription, and the handles of each op."""

    def __init__(self, limit: int | None) -> None:
        self.ds = Dataspace()
        self.ds.max_turn_events = limit
        self.log: list = []
        self.entities = [Recorder(self.log, i, self.show) for i in range(3)]
        self.ds.observe("<a $x>", on_assert=lambda x: self.log.append(("sub", "+", x)),
                        on_retract=lambda x: self.log.append(("sub", "-", x)),
                        on_message=lambda x: self.log.append(("sub", "!", x)))
        self.handles: dict[int, int] = {}  # op number -> handle
        self.cuts: list[int] = []  # where each turn's events end in the log

    def value(self, op):
        kind, a, b = op
        if kind == "observe":
            return Record(Symbol("Observe"), [PATTERNS[a], Embedded(self.entities[b])])
        return VALUES[a]

    def run(self, ops: list, as_turn: bool, first_op: int) -> None:
        def act():
            for i, op in enumerate(ops):
                kind = op[0]
                if kind in ("assert", "observe"):
                    self.handles[first_op + i] = self.ds.assert_(self.value(op))
                elif kind == "retract":
                    live = sorted(self.handles)
                    if live:
                        self.ds.retract(self.handles.pop(live[op[1] % len(live)]))
                else:
                    self.ds.send(self.value(op))

        if as_turn:
            with self.ds.turn():
                act()
        else:
            act()

    def show(self, v) -> str:
        """Text of ``v`` with each embedded object named the same way on both sides."""
        names = {id(e): e.name for e in self.entities}
        return stringify(v, embedded=lambda o: names.get(id(o), "sub"))

    def state(self):
        return sorted(map(self.show, self.ds.assertions()))


ops = st.one_of(
    st.tuples(st.just("assert"), st.integers(0, len(VALUES) - 1), st.just(0)),
    st.tuples(st.just("observe"), st.integers(0, len(PATTERNS) - 1), st.integers(0, 2)),
    st.tuples(st.just("retract"), st.integers(0, 20), st.just(0)),
    st.tuples(st.just("send"), st.integers(0, len(VALUES) - 1), st.just(0)),
)
turns = st.lists(st.tuples(st.lists(ops, min_size=1, max_size=6), st.booleans()), max_size=25)


@settings(max_examples=300, deadline=None)
@given(turns, st.integers(1, 8))
# A refused turn that took two observers away and reinstalled them: they then hear the
# next assertion in another order than the reference's, each its own events unchanged.
@example([([("assert", 0, 0), ("observe", 0, 0)], False),
          ([("assert", 0, 0), ("assert", 0, 0), ("observe", 2, 0), ("observe", 2, 1)], False),
          ([("assert", 1, 0), ("retract", 0, 0), ("retract", 1, 0), ("send", 0, 0),
            ("send", 0, 0)], False),
          ([("assert", 2, 0)], False)], 2)
# A rollback re-adds <a 1>: an observer installed later hears <a 1> and <a 2> in another
# order than the reference's, in one turn.
@example([([("assert", 0, 0)], False),
          ([("assert", 0, 0)] * 4 + [("retract", 0, 0)] * 2, False),
          ([("assert", 0, 0)] * 2 + [("retract", 0, 0)] * 2, False),
          ([("assert", 1, 0)] + [("retract", 0, 0)] * 3 + [("send", 0, 0), ("observe", 1, 0)],
           False),
          ([("assert", 1, 0), ("observe", 1, 0)], False)], 3)
def test_refused_turns_leave_no_trace(program, limit):
    metered, ref = Side(limit), Side(None)
    n = 0
    for turn_ops, as_turn in program:
        single = len(turn_ops) == 1 and not as_turn
        before_log = len(metered.log)
        before_handles = dict(metered.handles)
        try:
            metered.run(turn_ops, as_turn or not single, n)
        except TurnTooLarge:
            event("a turn was refused")
            # Nothing of it happened: no event heard, no assertion left, handles dead.
            assert len(metered.log) == before_log
            for i in range(n, n + len(turn_ops)):
                h = metered.handles.pop(i, None)
                if h is not None:
                    assert metered.ds.value_of(h) is None
            metered.handles = before_handles
            assert metered.state() == ref.state()
        else:
            ref.run(turn_ops, as_turn or not single, n)
            metered.cuts.append(len(metered.log))
            ref.cuts.append(len(ref.log))
        n += len(turn_ops)
        assert heard(metered) == heard(ref)
        assert metered.state() == ref.state()
    # Everything retracted at the end: both dataspaces empty out the same way.
    for side in (metered, ref):
        with side.ds.turn():
            for h in side.handles.values():
                side.ds.retract(h)
    assert heard(metered) == heard(ref)
    assert metered.state() == ref.state()


def test_a_refused_turn_raises_a_clear_error_and_the_dataspace_goes_on():
    ds = Dataspace()
    ds.max_turn_events = 10
    heard = []
    for _ in range(4):
        ds.observe("<x $n>", on_assert=heard.append)
    with pytest.raises(TurnTooLarge, match="more than 10 events"), ds.turn():
        for i in range(3):
            ds.assert_(parse(f"<x {i}>"))  # 4 observers x 3 = 12 deliveries
    assert heard == []
    assert len(ds.assertions()) == 4
    assert all(a.label == Symbol("Observe") for a in ds.assertions())
    with ds.turn():
        ds.assert_(parse("<x 1>"))
        ds.assert_(parse("<x 2>"))
    assert sorted(heard) == [1, 1, 1, 1, 2, 2, 2, 2]


def test_retractions_are_never_refused():
    ds = Dataspace()
    hs = [ds.assert_(parse(f"<x {i}>")) for i in range(5)]
    for _ in range(4):
        ds.observe("<x $n>")
    ds.max_turn_events = 3  # each of the 5 values is held by 4 observers: 20 retractions
    with ds.turn():
        for h in hs:
            ds.retract(h)
    assert not any(a.label == Symbol("x") for a in ds.assertions())


def test_observers_going_together_do_not_hear_each_other_go():
    """A peer dropping n observers of everything in one turn must not cost n**2."""
    ds = Dataspace()
    heard = []

    class Counter(Entity):
        def on_assert(self, value, handle):
            heard.append("+")

        def on_retract(self, handle):
            heard.append("-")

    n = 60
    obs = [
        ds.assert_(Record(Symbol("Observe"), [to_preserves(parse_pattern("$x")), Embedded(Counter())]))
        for _ in range(n)
    ]
    # Each observer heard every Observe assertion, its own included: n*n events.
    assert heard.count("+") == n * n
    heard.clear()
    observers = [cb for _pat, cb in ds._observers.values()]
    delivered = sum(o.delivered for o in observers)
    with ds.turn():
        for h in obs:
            ds.retract(h)
    # Each observer is told the retraction of what it held (n each, as it goes), but
    # nothing is delivered to an observer that is already gone: n*n retractions, and
    # no event reaches any of them through the index (it would, were they uninstalled
    # one by one: the others would hear each one go).
    assert heard.count("-") == n * n
    assert sum(o.delivered for o in observers) == delivered


def test_observers_of_a_dead_entity_cost_nothing():
    ds = Dataspace()

    class Mortal(Entity):
        alive = True
        heard: list = []

        def on_assert(self, value, handle):
            self.heard.append(value)

    m = Mortal()
    ds.assert_(Record(Symbol("Observe"), [to_preserves(parse_pattern("$x")), Embedded(m)]))
    ds.assert_(parse("<y>"))
    assert len(m.heard) == 2  # its own Observe, and <y>
    m.alive = False  # e.g. a RemoteEntity whose connection has closed
    ds.assert_(parse("<z>"))
    assert len(m.heard) == 2
