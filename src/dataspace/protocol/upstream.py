"""Subscription upstreaming between linked brokers (seed 001), over Preserves patterns.

Sans-IO, like the relay: no sockets, no clocks (time comes in as ``now``), no threads.
Two machines per direction of a link:

* :class:`Subscriber` -- on the side that *wants* (downstream, S in the seed): a trie of
  entries with the flags POSITIVE / SYNCHRONIZED / PENDING / CANONICAL, fed by local
  interest (``add_interest``/``remove_interest``) and by what arrives from the producer
  (``received``); it sends SUBSCRIBE / REJECT / RESET requests and acts on CONFIRMs;
* :class:`Producer` -- on the side that *has* the data (upstream, P): a trie of POSITIVE
  and NEGATIVE entries built from those requests, deciding what crosses the link
  (``forward``) and answering each request with a CONFIRM.

**Prefixes of patterns and values.**  The seed's topics are strings and subscriptions
are their prefixes.  Here a *chain* is the sequence of constraints a pattern fixes, in
visit order (depth first, fields in order), up to the first position it leaves open:
each constraint is ``(path, item)`` where ``item`` is the class of the value there
(``<rec LABEL>``, ``<arr>``, ``<dict>``) or an atom (``<lit ATOM>``).  So
``<Says "alice" $text>`` gives ``[(() <rec Says>) ((0) <lit "alice">)]`` and
``<Says $who "hi">`` only ``[(() <rec Says>)]`` (its constraint on field 1 comes after the
open field 0: a coarser entry, which costs bandwidth, never correctness -- the receiving
dataspace filters exactly).  A dictionary pattern stops at ``<dict>``.  A chain *matches*
a value when every constraint holds; the root chain ``[]`` matches everything, and a
chain is the trie parent of the chains it is a prefix of.  A value's own chain (all of
its structure, dictionaries and their contents excepted) is what REJECT uses.

**Choices where the seed leaves room** (docs/links.md says them for users):

* *Assertions* need interest up front: a subscriber whose observer waits for
  ``<Present _>`` would never receive the message that, in the seed, triggers its
  SUBSCRIBE.  So by default (``eager=True``) a new canonical entry is subscribed at once,
  and a new session (a reconnection) subscribes every canonical entry once: one round,
  one request each, no more.  The root artifact (the empty chain, POSITIVE and
  SYNCHRONIZED when a session starts) lets *messages* flow until the subscriptions are
  confirmed, and is then RESET as in the seed; it never forwards *assertions* (that
  would copy every assertion across at each reconnection).  ``eager=False`` is the
  seed's lazy mode: at most one subscription request per producer message.
* *Retransmission and pacing*, as TCP does them: a request unconfirmed within the
  timeout is sent again (doubling up to ``rto_max``); the timeout follows the measured
  round trips (SRTT + 4 RTTVAR, at least ``rto``; Karn's rule); nothing is resent while
  CONFIRMs keep arriving for other requests, unless overdue by more than ``rto_max``;
  at most a window of requests is in flight (starting at 32, opening by one per request
  confirmed, up to ``window``), the rest wait.  Requests carry a sequence number and the
  lowest one still unconfirmed; the producer ignores what is older than the latest it
  applied for that chain, and drops whatever is below that low mark, so duplicated,
  delayed and reordered requests are harmless.  A CONFIRM names its request by number.
* *Unsubscribing* (not in the seed): the entry loses CANONICAL; if the producer has it,
  it is RESET; then steps 2-3 of the seed run from its parent (so the root artifact,
  or a negative, can go when nothing under it needs it).
* The REJECT of a value no entry matches names the value's one-constraint chain (its
  label, say), not the empty chain: it suppresses a category, not everything.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..pattern import Arr, Bind, Dict, Discard, Lit, Pattern, Rec
from ..values import Dictionary, Embedded, Record, Sequence, Set, Symbol, Value, key

__all__ = [
    "CANONICAL",
    "CONFIRM",
    "PENDING",
    "POSITIVE",
    "REJECT",
    "RESET",
    "SUBSCRIBE",
    "SYNCHRONIZED",
    "Chain",
    "Producer",
    "Subscriber",
    "UpstreamError",
    "chain_from_value",
    "chain_key",
    "chain_matches",
    "chain_to_value",
    "pattern_chain",
    "value_chain",
]

MAX_CHAIN = 64
"""Longest chain accepted from a peer (constraints)."""
MAX_PATH = 32
"""Deepest path accepted from a peer."""

SUBSCRIBE = Symbol("subscribe")
REJECT = Symbol("reject")
RESET = Symbol("reset")
CONFIRM = Symbol("confirm")
_REC, _ARR, _DICT, _LIT = Symbol("rec"), Symbol("arr"), Symbol("dict"), Symbol("lit")

# -- the subscriber's flags (seed 001), and what each request does ------------------------

POSITIVE = 1       # absent: a negative ("ignore") entry
SYNCHRONIZED = 2   # the producer acknowledged it
PENDING = 4        # a request for it is unconfirmed
CANONICAL = 8      # wanted by the user (here: local interest), not a synchronisation artifact

#: request -> (flags the subscriber's entry has while it is pending, the producer's
#: entry after applying it: True positive, False negative, None deleted)
REQUESTS: dict[Symbol, tuple[int, bool | None]] = {
    SUBSCRIBE: (POSITIVE | PENDING, True),
    REJECT: (PENDING, False),
    RESET: (PENDING, None),
}


class UpstreamError(ValueError):
    """A link peer sent something this protocol does not allow (the link is closed)."""


# ---------------------------------------------------------------------------------------
# Chains

Path = tuple[int, ...]
Item = tuple[Any, ...]   # ("rec", label key, label) / ("arr",) / ("dict",) / ("lit", key, atom)
Constraint = tuple[Path, Item]
Chain = tuple[Constraint, ...]


def _item(v: Value) -> Item:
    t = type(v)
    if t is Record:
        return ("rec", key(v.label), v.label)
    if t is Sequence:
        return ("arr",)
    if t is Dictionary:
        return ("dict",)
    return ("lit", key(v), v)


def _item_key(item: Item) -> tuple[Any, ...]:
    return item[:2]


def _value_items(v: Value, path: Path, out: list[Constraint]) -> None:
    item = _item(v)
    out.append((path, item))
    if item[0] == "rec":
        for i, f in enumerate(v.fields):
            _value_items(f, (*path, i), out)
    elif item[0] == "arr":
        for i, x in enumerate(v):
            _value_items(x, (*path, i), out)


def value_chain(v: Value) -> Chain:
    """Every constraint ``v`` satisfies, in visit order (dictionaries: their class only)."""
    out: list[Constraint] = []
    _value_items(v, (), out)
    return tuple(out)


def pattern_chain(p: Pattern) -> Chain:
    """The constraints ``p`` fixes in visit order, up to the first open position."""
    out: list[Constraint] = []
    _pattern_items(p, (), out)
    return tuple(out)


def _pattern_items(p: Pattern, path: Path, out: list[Constraint]) -> bool:
    """Append ``p``'s constraints; False once an open position ends the prefix."""
    while type(p) is Bind:
        p = p.pattern
    t = type(p)
    if t is Discard:
        return False
    if t is Lit:
        v = p.value
        if type(v) in (Record, Sequence, Dictionary):
            items: list[Constraint] = []
            _value_items(v, path, items)
            out += items
            return type(v) is not Dictionary
        out.append((path, _item(v)))
        return True
    if t is Rec or t is Arr:
        out.append((path, ("rec", p._label_key, p.label) if t is Rec else ("arr",)))
        subs = dict(p.fields if t is Rec else p.items)
        for i in range(max(subs) + 1 if subs else 0):
            sub = subs.get(i)
            if sub is None or not _pattern_items(sub, (*path, i), out):
                return False
        return True
    if t is Dict:
        out.append((path, ("dict",)))
        return False
    raise TypeError(f"not a pattern: {p!r}")  # pragma: no cover


def _at(v: Any, path: Path) -> Any:
    for i in path:
        t = type(v)
        if t is Record:
            f = v.fields
            if i >= len(f):
                return _MISSING
            v = f[i]
        elif t is Sequence:
            if i >= len(v):
                return _MISSING
            v = v[i]
        else:
            return _MISSING
    return v


_MISSING = object()


def _holds(c: Constraint, v: Value) -> bool:
    x = _at(v, c[0])
    return x is not _MISSING and _item_key(_item(x)) == _item_key(c[1])


def chain_matches(chain: Chain, v: Value) -> bool:
    """Whether every constraint of ``chain`` holds on ``v``."""
    return all(_holds(c, v) for c in chain)


def chain_to_value(chain: Chain) -> Value:
    """The wire form: ``[[PATH ITEM] ...]``, ``PATH`` a list of indices, ``ITEM`` one of
    ``<rec LABEL>``, ``<arr>``, ``<dict>``, ``<lit ATOM>``."""
    out = []
    for path, item in chain:
        kind = item[0]
        if kind == "rec":
            it: Value = Record(_REC, [item[2]])
        elif kind == "arr":
            it = Record(_ARR, [])
        elif kind == "dict":
            it = Record(_DICT, [])
        else:
            it = Record(_LIT, [item[2]])
        out.append(Sequence([Sequence(path), it]))
    return Sequence(out)


def chain_from_value(v: Value) -> Chain:
    """Read and check a chain from the wire; raises :class:`UpstreamError`."""
    if type(v) is not Sequence or len(v) > MAX_CHAIN:
        raise UpstreamError(f"a chain is a list of at most {MAX_CHAIN} [path item] pairs")
    out: list[Constraint] = []
    for c in v:
        if type(c) is not Sequence or len(c) != 2:
            raise UpstreamError("a chain constraint is [path item]")
        path, it = c
        if (type(path) is not Sequence or len(path) > MAX_PATH
                or not all(type(i) is int and 0 <= i < 1 << 16 for i in path)):
            raise UpstreamError(f"a path is a list of at most {MAX_PATH} small indices")
        if type(it) is not Record or type(it.label) is not Symbol:
            raise UpstreamError("a chain item is <rec L>, <arr>, <dict> or <lit ATOM>")
        lab, f = it.label, it.fields
        if lab == _REC and len(f) == 1:
            item: Item = ("rec", key(f[0]), f[0])
        elif lab == _ARR and not f:
            item = ("arr",)
        elif lab == _DICT and not f:
            item = ("dict",)
        elif lab == _LIT and len(f) == 1 and type(f[0]) not in (Record, Sequence, Dictionary):
            item = ("lit", key(f[0]), f[0])
        else:
            raise UpstreamError("a chain item is <rec L>, <arr>, <dict> or <lit ATOM>")
        t = tuple(path)
        if t and not any(p == t[:-1] for p, _i in out):
            # (So that what a constraint looks at -- a record's field or a sequence's
            # item -- is known: chains of patterns and values always say it first.)
            raise UpstreamError("a chain constrains a path only after the value holding it")
        out.append((t, item))
    return tuple(out)


def _ckey(c: Constraint) -> tuple[Any, ...]:
    return (c[0], *_item_key(c[1]))


def chain_key(chain: Chain) -> tuple[Any, ...]:
    """A hashable key of ``chain`` with Preserves equality (1, 1.0 and #t differ)."""
    return tuple(map(_ckey, chain))


# ---------------------------------------------------------------------------------------
# Tries keyed by chains


class _Node:
    """A trie node: its chain, children by (path, item), and an entry (or none)."""

    __slots__ = (
        "canon",
        "chain",
        "explicit",
        "flags",
        "kids",
        "kind",
        "out",
        "parent",
        "rto",
        "sent_at",
        "seq",
        "tries",
        "unc",
        "unc_kids",
        "wire",
    )

    def __init__(self, parent: _Node | None, chain: Chain) -> None:
        self.parent = parent
        self.chain = chain
        # path -> {item key -> child}: a value is looked up once per distinct path.
        self.kids: dict[Path, dict[tuple[Any, ...], _Node]] = {}
        self.flags: int | None = None   # None: no entry here
        self.canon = 0                  # local interests naming this chain
        self.seq = -1                   # subscriber: the request in flight; producer: last applied
        self.kind: Symbol | None = None  # the request in flight
        self.sent_at = 0.0
        self.rto = 0.0
        self.wire: Value | None = None  # chain_to_value(chain), made once when first sent
        self.out = False  # subscriber: the request in flight has been sent (not waiting)
        self.tries = 0    # subscriber: times the request in flight was sent
        # Subscriber: entries in this subtree not covered by a SUBSCRIBED entry on the
        # way up to this node's parent ("unc"), and the sum of it over the children.
        self.unc = 0
        self.unc_kids = 0
        self.explicit = False           # producer: the root was asked for, not the default

    def child(self, c: Constraint) -> _Node | None:
        t = self.kids.get(c[0])
        return None if t is None else t.get(_item_key(c[1]))

    def children(self) -> Iterator[_Node]:
        for t in self.kids.values():
            yield from t.values()


class _Trie:
    def __init__(self) -> None:
        self.root = _Node(None, ())

    def find(self, chain: Chain) -> _Node | None:
        n: _Node | None = self.root
        for c in chain:
            assert n is not None
            n = n.child(c)
            if n is None:
                return None
        return n

    def make(self, chain: Chain) -> _Node:
        n = self.root
        for i, c in enumerate(chain):
            nxt = n.child(c)
            if nxt is None:
                nxt = _Node(n, chain[: i + 1])
                n.kids.setdefault(c[0], {})[_item_key(c[1])] = nxt
            n = nxt
        return n

    def prune(self, n: _Node) -> None:
        """Remove ``n`` and its empty ancestors once they hold nothing."""
        while n.parent is not None and n.flags is None and not n.kids and not n.canon:
            p = n.parent
            path, item = n.chain[-1]
            key = _item_key(item)
            t = p.kids.get(path)
            if t is None or t.get(key) is not n:
                return  # already gone (pruned with a descendant, or buried twice)
            del t[key]
            if not t:
                del p.kids[path]
            n = p

    def matching(self, v: Value) -> list[_Node]:
        """Entries whose chain matches ``v``, ancestors first (pre-order)."""
        out: list[_Node] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.flags is not None:
                out.append(n)
            kids = n.kids
            if kids:
                found = []
                for path, table in kids.items():
                    x = _at(v, path)
                    if x is _MISSING:
                        continue
                    c = table.get(_item_key(_item(x)))
                    if c is not None:
                        found.append(c)
                stack += reversed(found)
        return out

    def entries(self) -> Iterator[_Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.flags is not None:
                yield n
            stack.extend(n.children())


_NONE, _NEGATIVE, _YES = 0, 1, 2
_ARR_KEY, _DICT_KEY = ("arr",), ("dict",)
_PLAIN_NOINT = frozenset({str, bytes, Symbol, Record, Sequence, Set, Dictionary, Embedded})
"""Types whose strict key (:func:`key`) is the value itself."""


def _decide(n: _Node, v: Value, skip: _Node | None) -> int:
    """The producer's rule on the entries under ``n`` (which ``v`` matches): _YES if some
    POSITIVE entry (not ``skip``) has no NEGATIVE one below it that ``v`` matches, else
    _NEGATIVE if such a negative is there, else _NONE.  One walk, no lists, a leaf
    decided without a call: this runs for every message a link may forward."""
    below = _NONE
    kids = n.kids
    if kids:
        for path, table in kids.items():
            x = v
            for i in path:  # _at, inline
                t = type(x)
                if t is Record:
                    f = x.fields
                    if i >= len(f):
                        x = _MISSING
                        break
                    x = f[i]
                elif t is Sequence and i < len(x):
                    x = x[i]
                else:
                    x = _MISSING
                    break
            if x is _MISSING:
                continue
            t = type(x)
            if t is Record:
                lab = x.label
                k: tuple[Any, ...] = ("rec", lab if type(lab) in _PLAIN_NOINT else key(lab))
            elif t is Sequence:
                k = _ARR_KEY
            elif t is Dictionary:
                k = _DICT_KEY
            else:
                k = ("lit", x if t in _PLAIN_NOINT else key(x))
            c = table.get(k)
            if c is None:
                continue
            if c.kids:
                r = _decide(c, v, skip)
            else:  # a leaf: its own entry decides
                cf = c.flags
                r = (_NONE if cf is None else _NEGATIVE if cf == 0
                     else _YES if c is not skip else _NONE)
            if r == _YES:
                return _YES
            below |= r
    f = n.flags
    if f is None:
        return below
    if f == 0:
        return _NEGATIVE
    if below == _NONE and n is not skip:
        return _YES
    return below


# ---------------------------------------------------------------------------------------
# The subscriber (S)


@dataclass
class SubscriberStats:
    entries: int = 0
    subscribed: int = 0       # POSITIVE and SYNCHRONIZED
    negative: int = 0
    pending: int = 0
    canonical: int = 0
    requests_sent: int = 0    # SUBSCRIBE / REJECT / RESET, retransmissions included
    retransmissions: int = 0
    triggered_by_messages: int = 0   # requests sent because of a producer message
    passed: int = 0           # producer messages passed to the user
    dropped: int = 0          # producer messages no canonical entry wanted


class Subscriber:
    """The subscriber's machine of seed 001 (see the module docstring)."""

    INITIAL_WINDOW = 32

    def __init__(self, *, eager: bool = True, rto: float = 1.0, rto_max: float = 30.0,
                 window: int = 1000) -> None:
        self.eager = eager
        self.window = window
        """Requests sent and not yet confirmed, at most; more wait their turn (a
        reconnection's round of 10,000 goes out as confirmations come back, so none waits
        long enough to be resent)."""
        self._inflight = 0
        self._waiting: deque[tuple[int, _Node]] = deque()
        # As TCP does: a congestion window that starts small and grows by one per
        # request confirmed at its first sending (so the first round trips are measured
        # before a large round goes out), and a timeout from the measured round trips
        # (RFC 6298: SRTT + 4 RTTVAR, at least ``rto``; kept across sessions).
        self._cwnd = float(min(self.INITIAL_WINDOW, window))
        self._srtt: float | None = None
        self._rttvar = 0.0
        self._rto = rto
        # The pending requests, by seq (a CONFIRM names its request by seq alone): a node
        # is pending when it is here under its current seq.
        self._by_number: dict[int, _Node] = {}
        self.rto0 = rto
        self.rto_max = rto_max
        self.trie = _Trie()
        self._out: list[Value] = []
        # Heaps over the pending requests (stale entries skipped when met): by deadline,
        # for tick/next_deadline, and by seq, for the low mark -- O(log n) per request,
        # so a reconnection subscribing 10,000 prefixes costs no more than 10,000 requests.
        self._by_time: list[tuple[float, int, _Node]] = []
        self._by_seq: list[tuple[int, _Node]] = []
        self._seq = 0
        self.stats = SubscriberStats()
        self._now = 0.0
        self._progress = float("-inf")  # when a CONFIRM last completed a pending request
        self.start(0.0)

    # -- sessions ---------------------------------------------------------------------

    def start(self, now: float) -> None:
        """A new session (the link (re)connected): the producer starts from scratch, with
        the root artifact forwarding messages.  Canonical entries are kept, unsynchronized;
        artifacts go; with ``eager``, every canonical entry is subscribed once."""
        self._now = now
        self.stats.requests_sent -= len(self._out)  # queued, never taken: never sent
        self._out.clear()
        for n in self._by_number.values():
            n.out = False
        self._by_number.clear()
        self._inflight = 0
        self._waiting.clear()
        # A new connection starts slow, as TCP does after a restart; the timeout learned
        # from the peer is kept.
        self._cwnd = float(min(self.INITIAL_WINDOW, self.window))
        self._by_time.clear()
        self._by_seq.clear()
        self._seq = 0
        self._progress = float("-inf")
        for n in list(self.trie.entries()):
            n.kind = None
            if n.canon:
                n.flags = POSITIVE | CANONICAL
            elif n is not self.trie.root:
                n.flags = None
        root = self.trie.root
        root.flags = POSITIVE | SYNCHRONIZED | (CANONICAL if root.canon else 0)
        self._recount(self.trie.root)
        if self.eager or root.canon:
            for n in list(self.trie.entries()):
                if n.canon and (self.eager or n is root):
                    self._request(n, SUBSCRIBE)
        self._steps_2_3(root)
        for n in self._all_nodes():
            self.trie.prune(n)

    def _all_nodes(self) -> list[_Node]:
        out, stack = [], [self.trie.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children())
        return out

    # -- local interest -----------------------------------------------------------------

    def add_interest(self, chain: Chain, now: float | None = None) -> None:
        """The user subscribes to ``chain`` (counted: several patterns may share it).
        ``now`` stamps the request it may send (default: the last time given)."""
        if now is not None:
            self._now = now
        n = self.trie.make(chain)
        n.canon += 1
        if n.canon > 1:
            return
        f = n.flags
        if f is None or not f & POSITIVE or n.kind is RESET:
            # New, a negative artifact, or going away: it becomes a wanted subscription.
            n.flags = POSITIVE | CANONICAL
            self._changed(n)
            if self.eager or not self._root_present() or n is self.trie.root:
                self._request(n, SUBSCRIBE)
        else:
            n.flags = f | CANONICAL
            self._changed(n)
            if n is self.trie.root and n.kind is not SUBSCRIBE:
                # The root artifact forwards messages only: ask for everything.
                self._request(n, SUBSCRIBE)

    def remove_interest(self, chain: Chain, now: float | None = None) -> None:
        """The user no longer subscribes to ``chain`` (one of its counted interests)."""
        if now is not None:
            self._now = now
        n = self.trie.find(chain)
        if n is None or n.canon == 0:
            return
        n.canon -= 1
        if n.canon:
            return
        f = n.flags
        assert f is not None
        if n is self.trie.root:
            n.flags = f & ~CANONICAL
            self._changed(n)
            self._steps_2_3(n)
            return
        if f & (SYNCHRONIZED | PENDING):
            n.flags = f & ~CANONICAL
            self._changed(n)
            self._request(n, RESET)
        else:  # never told the producer: just forget it
            n.flags = None
            self._changed(n)
            parent = n.parent
            self.trie.prune(n)
            if parent is not None:
                self._steps_2_3(parent)

    def _root_present(self) -> bool:
        return self.trie.root.flags is not None

    # -- what the producer sends ----------------------------------------------------------

    def received(self, value: Value, now: float) -> bool:
        """A message (or assertion) arrived from the producer.  Returns whether it is for
        the user (it matches a POSITIVE, CANONICAL entry); may queue one request."""
        self._now = now
        found = self.trie.matching(value)
        if not found:
            # Nothing here wants it: a negative entry for its shortest chain, and REJECT.
            chain = value_chain(value)[:1]
            n = self.trie.make(chain)
            n.flags = 0
            self._changed(n)
            self._request(n, REJECT)
            self.stats.triggered_by_messages += 1
            self.stats.dropped += 1
            return False
        wanted = False
        asked = False
        for n in found:  # root first
            f = n.flags
            assert f is not None
            if f & POSITIVE and f & CANONICAL:
                wanted = True
            if asked or f & (SYNCHRONIZED | PENDING):
                continue
            if f & CANONICAL and f & POSITIVE:
                self._request(n, SUBSCRIBE)
                self.stats.triggered_by_messages += 1
                asked = True
        if wanted:
            self.stats.passed += 1
        else:
            self.stats.dropped += 1
        return wanted

    def on_confirm(self, msg: Value, now: float) -> None:
        """A ``<confirm KIND SEQ>`` arrived; raises :class:`UpstreamError` if malformed."""
        self._now = now
        kind, seq = _read_confirm(msg)
        self._confirmed(kind, seq, now)
        self._release()

    def _confirmed(self, kind: Symbol, seq: int, now: float) -> None:
        n = self._by_number.get(seq)
        if n is None or n.kind is not kind or n.seq != seq:
            return  # stale or duplicated: that request is superseded or done
        del self._by_number[seq]
        if n.out:
            n.out = False
            self._inflight -= 1
            if n.tries == 1:  # Karn: a resent request's round trip is ambiguous
                self._sample(now - n.sent_at)
        self._progress = now
        n.kind = None
        f = n.flags
        assert f is not None
        if kind is RESET:
            if f & CANONICAL:  # wanted again meanwhile: subscribe it again
                n.flags = POSITIVE | CANONICAL
                self._changed(n)
                self._request(n, SUBSCRIBE)
                return
            n.flags = None
            self._changed(n)
            parent = n.parent
            self.trie.prune(n)
            if parent is not None:
                self._steps_2_3(parent)
            return
        # SUBSCRIBE or REJECT: 1. synchronized, no longer pending
        n.flags = (f | SYNCHRONIZED) & ~PENDING
        self._changed(n)
        self._steps_2_3(n)

    def _steps_2_3(self, n: _Node) -> None:
        """2. from ``n`` towards the root, the first entry that is not CANONICAL; 3. if
        everything under it is SUBSCRIBED or under a SUBSCRIBED entry, RESET it."""
        x: _Node | None = n
        while x is not None and (x.flags is None or x.flags & CANONICAL):
            x = x.parent
        if x is None or x.flags is None or x.kind is not None:
            return
        if x.unc_kids == 0:
            self._request(x, RESET)

    # -- requests and retransmission ----------------------------------------------------

    def _request(self, n: _Node, kind: Symbol) -> None:
        if self._by_number.get(n.seq) is n:  # superseded: the old seq's CONFIRM is stale
            del self._by_number[n.seq]
        n.seq = self._seq
        self._by_number[n.seq] = n
        self._seq += 1
        n.kind = kind
        f = n.flags or 0
        if kind is SUBSCRIBE:
            n.flags = (f | REQUESTS[SUBSCRIBE][0]) & ~SYNCHRONIZED
        else:
            n.flags = f | PENDING
        self._changed(n)
        if n.out:  # it replaces a request in flight, whose CONFIRM will be stale
            n.out = False
            self._inflight -= 1
        heapq.heappush(self._by_seq, (n.seq, n))
        if self._waiting or not self._room():
            self._waiting.append((n.seq, n))
            self._release()  # (room may have been made above)
        else:
            self._transmit(n)

    def _sample(self, rtt: float) -> None:
        """A measured round trip: update the timeout, and open the window by one."""
        if self._srtt is None:
            self._srtt, self._rttvar = rtt, rtt / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - rtt)
            self._srtt = 0.875 * self._srtt + 0.125 * rtt
        self._rto = min(self.rto_max, max(self.rto0, self._srtt + 4 * self._rttvar))
        if self._cwnd < self.window:
            self._cwnd += 1

    @property
    def timeout(self) -> float:
        """The current retransmission timeout (seconds), before any backing off."""
        return self._rto

    def _room(self) -> bool:
        return self._inflight < min(self.window, int(self._cwnd))

    def _transmit(self, n: _Node) -> None:
        n.out = True
        n.tries = 1
        self._inflight += 1
        n.rto = self._rto
        n.sent_at = self._now
        heapq.heappush(self._by_time, (n.sent_at + n.rto, n.seq, n))
        self._send(n)

    def _release(self) -> None:
        """Send waiting requests while the window has room (superseded ones are skipped)."""
        w = self._waiting
        while w and self._room():
            seq, n = w.popleft()
            if self._live(n, seq) and not n.out:
                self._transmit(n)

    def _live(self, n: _Node, seq: int) -> bool:
        return n.seq == seq and self._by_number.get(seq) is n

    def _low(self) -> int:
        h = self._by_seq
        while h and not self._live(h[0][1], h[0][0]):
            heapq.heappop(h)
        return h[0][0] if h else self._seq

    def _send(self, n: _Node) -> None:
        assert n.kind is not None
        wire = n.wire
        if wire is None:
            wire = n.wire = chain_to_value(n.chain)
        self._out.append(Record(n.kind, [n.seq, self._low(), wire]))
        self.stats.requests_sent += 1

    def _horizon(self, now: float) -> float:
        """Requests whose deadline is at or before this are resent.  While CONFIRMs keep
        completing requests (within ``rto`` of now) the producer is working through a
        backlog, not losing requests: as TCP restarts its timer on an ACK of new data,
        nothing is resent then, unless it is overdue by more than ``rto_max``."""
        if now >= self._progress + self.rto0:
            return now
        return now - self.rto_max

    def tick(self, now: float) -> None:
        """Resend what has waited too long for its CONFIRM."""
        self._now = now
        h = self._by_time
        horizon = self._horizon(now)
        resent = False
        while h and h[0][0] <= horizon:
            _t, seq, n = heapq.heappop(h)
            if not self._live(n, seq):
                continue
            if n.sent_at + n.rto > horizon:  # not due after all: keep it
                heapq.heappush(h, (n.sent_at + n.rto, seq, n))
                continue
            n.sent_at = now
            n.rto = min(n.rto * 2, self.rto_max)
            n.tries += 1
            resent = True
            self.stats.retransmissions += 1
            self._send(n)
            heapq.heappush(h, (n.sent_at + n.rto, n.seq, n))
        if resent:  # a loss, or a peer slower than we thought: start small, wait longer
            self._cwnd = float(min(self.INITIAL_WINDOW, self.window))
            self._rto = min(self.rto_max, self._rto * 2)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` has something to do, if ever."""
        h = self._by_time
        while h and not self._live(h[0][2], h[0][1]):
            heapq.heappop(h)
        if not h:
            return None
        due = h[0][0]
        return min(max(due, self._progress + self.rto0), due + self.rto_max)

    @property
    def settled(self) -> bool:
        """Eager, nothing pending and no root artifact: the producer's entries are this
        side's canonical ones (and the negatives it was told of), so whatever it sends
        on an ordered transport is wanted (:meth:`received` would say so, and ask
        nothing) -- a host may skip :meth:`received` for messages then."""
        root = self.trie.root
        return self.eager and not self._by_number and (root.flags is None or root.canon > 0)

    def take_outgoing(self) -> list[Value]:
        """Requests to send to the producer, in order."""
        out, self._out = self._out, []
        return out

    # -- "uncovered" counts (step 3 in O(depth)) --------------------------------------------

    def _own_unc(self, n: _Node) -> int:
        f = n.flags
        if f is not None and f & POSITIVE and f & SYNCHRONIZED and not f & PENDING:
            return 0  # SUBSCRIBED: covers everything under it
        return (1 if f is not None else 0) + n.unc_kids

    def _changed(self, n: _Node) -> None:
        m: _Node | None = n
        while m is not None:
            new = self._own_unc(m)
            if new == m.unc:
                return
            delta = new - m.unc
            m.unc = new
            m = m.parent
            if m is not None:
                m.unc_kids += delta

    def _recount(self, n: _Node) -> int:
        n.unc_kids = sum(self._recount(c) for c in n.children())
        n.unc = self._own_unc(n)
        return n.unc

    # -- inspection -----------------------------------------------------------------------

    def entries(self) -> list[tuple[Chain, int, int]]:
        """``(chain, flags, canonical count)`` of every entry."""
        return [(n.chain, n.flags or 0, n.canon) for n in self.trie.entries()]

    def canonical(self) -> set[tuple[Any, ...]]:
        """The chain keys (:func:`chain_key`) of the canonical entries."""
        return {chain_key(n.chain) for n in self.trie.entries() if n.canon}

    def summary(self) -> SubscriberStats:
        s = self.stats
        s.entries = s.subscribed = s.negative = s.pending = s.canonical = 0
        for n in self.trie.entries():
            f = n.flags or 0
            s.entries += 1
            if f & POSITIVE and f & SYNCHRONIZED:
                s.subscribed += 1
            if not f & POSITIVE:
                s.negative += 1
            if f & PENDING:
                s.pending += 1
            if n.canon:
                s.canonical += 1
        return s


def _read_confirm(msg: Value) -> tuple[Symbol, int]:
    if (type(msg) is not Record or msg.label != CONFIRM or len(msg.fields) != 2
            or msg.fields[0] not in REQUESTS or type(msg.fields[1]) is not int):
        raise UpstreamError("expected <confirm subscribe|reject|reset SEQ>")
    kind = next(k for k in REQUESTS if k == msg.fields[0])
    return kind, msg.fields[1]


# ---------------------------------------------------------------------------------------
# The producer (P)


class Producer:
    """The producer's machine of seed 001 (see the module docstring).

    Its trie starts with the root artifact: messages are forwarded until the subscriber
    says what it wants (assertions only under entries it asked for).  ``max_entries``
    bounds the trie (a subscriber asking for more is refused: :class:`UpstreamError`).
    """

    def __init__(self, *, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self.trie = _Trie()
        self._out: list[Value] = []
        self.low = 0
        self.count = 0
        self.positives = 0  # POSITIVE entries (the root artifact included): 0, nothing crosses
        self.requests = 0
        self._tombs: deque[_Node] = deque()
        self.start()

    def start(self) -> None:
        """A new session: only the root artifact."""
        self.trie = _Trie()
        self.trie.root.flags = POSITIVE
        self.trie.root.explicit = False
        self.count = 1
        self.positives = 1
        self.low = 0
        self._out.clear()
        self._tombs.clear()

    def on_request(self, msg: Value) -> Chain | None:
        """Apply a ``<subscribe|reject|reset SEQ LOW CHAIN>``; queue its CONFIRM.  Returns
        the chain whose entry changed (the host re-decides the assertions it matches),
        or None.  Raises :class:`UpstreamError` if malformed or over the limit."""
        if (type(msg) is not Record or msg.label not in REQUESTS or len(msg.fields) != 3
                or type(msg.fields[0]) is not int or type(msg.fields[1]) is not int):
            raise UpstreamError("expected <subscribe|reject|reset SEQ LOW CHAIN>")
        kind = next(k for k in REQUESTS if k == msg.label)
        seq, low, raw = msg.fields
        chain = chain_from_value(raw)
        self.requests += 1
        if low > self.low:
            self.low = low
            self._bury()
        if seq < self.low:
            return None  # older than anything the subscriber still waits for
        n = self.trie.find(chain)
        if n is not None and n.seq > seq:
            return None  # superseded by a later request for the same chain
        if n is not None and n.seq == seq:
            self._confirm(kind, seq)  # a duplicate: its CONFIRM may have been lost
            return None
        if n is None:
            if self.count >= self.max_entries:
                raise UpstreamError(f"too many subscription entries (the limit is {self.max_entries})")
            n = self.trie.make(chain)
        had = n.flags
        after = REQUESTS[kind][1]
        if after is None:
            if n.flags is not None:
                self.count -= 1
            n.flags = None
            n.explicit = False
            self._tombs.append(n)  # kept (with its seq) until older requests cannot matter
        else:
            if n.flags is None:
                self.count += 1
            n.flags = POSITIVE if after else 0
            n.explicit = bool(after)
        n.seq = seq
        self.positives += bool(n.flags) - bool(had)
        self._confirm(kind, seq)
        return chain if n.flags != had or kind is SUBSCRIBE else None

    def _bury(self) -> None:
        """Drop deleted entries whose seq is below the subscriber's low mark: every older
        request is ignored anyway."""
        tombs = self._tombs
        while tombs and tombs[0].seq < self.low:
            n = tombs.popleft()
            if n.flags is None and n.seq < self.low:
                self.trie.prune(n)

    def _confirm(self, kind: Symbol, seq: int) -> None:
        self._out.append(Record(CONFIRM, [kind, seq]))

    def take_outgoing(self) -> list[Value]:
        out, self._out = self._out, []
        return out

    def forward(self, value: Value, assertion: bool = False) -> bool:
        """Whether ``value`` crosses the link: it falls under a POSITIVE entry with no
        more specific NEGATIVE one (for an assertion, not the root artifact alone)."""
        root = self.trie.root
        skip = root if assertion and not root.explicit else None
        return _decide(root, value, skip) == _YES

    def forward_reference(self, value: Value, assertion: bool = False) -> bool:
        """:meth:`forward` by its definition, over every matching entry (for tests)."""
        found = self.trie.matching(value)
        for e in found:
            if not e.flags:
                continue
            if assertion and e is self.trie.root and not e.explicit:
                continue
            depth = len(e.chain)
            if not any(n.flags == 0 and len(n.chain) > depth and n.chain[:depth] == e.chain
                       for n in found):
                return True
        return False

    def has(self, chain: Chain) -> bool:
        """Whether the trie has an entry (positive or negative) for ``chain``."""
        n = self.trie.find(chain)
        return n is not None and n.flags is not None

    def wants(self, chain: Chain) -> bool:
        """Whether the subscriber asked for ``chain`` (a positive entry it requested; the
        root artifact is not a request)."""
        n = self.trie.find(chain)
        return n is not None and bool(n.flags) and (n is not self.trie.root or n.explicit)

    def entries(self) -> list[tuple[Chain, bool]]:
        """``(chain, positive)`` of every entry."""
        return [(n.chain, bool(n.flags)) for n in self.trie.entries()]

    def positive_chains(self, include_artifact: bool = False) -> set[tuple[Any, ...]]:
        """The chain keys of the positive entries (the root artifact only if asked)."""
        return {chain_key(n.chain) for n in self.trie.entries()
                if n.flags and (include_artifact or n is not self.trie.root or n.explicit)}
