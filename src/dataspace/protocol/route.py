"""Routing messages on their encoded bytes (sans-IO), with a match cache.

A server's hot path is a message arriving in a Turn packet and leaving in the Turn
packets of its subscribers.  This module lets it do that without building Python objects
for the message:

* :func:`scan` reads a message body straight from the packet's binary Preserves: it
  checks that the encoding is canonical (and so that its bytes identify its value) and
  finds the offsets of the items of the outermost record, sequence or dictionary.
  Nothing is decoded; strings are checked for valid UTF-8.
* :class:`MessageRouter` (one per dataspace) finds the observers of a message from a
  **match cache** keyed by what the message presents to the dataspace's patterns: its
  label (its *class*), how many fields it has, and the encodings of the fields the
  patterns of that class test against constants or shapes (NATS's subject -> subscribers
  cache, with a *projection* for a subject).  A miss decodes the message once and asks
  the dataspace's index; the answer is kept under that key.
* A remote subscriber gets the message as the bytes of its captures spliced into its
  outgoing Turn (``[capture ...]``, each capture the received bytes of that field); an
  in-process observer gets decoded captures, through the dataspace's queue, as before.
* A *forwarder* (a link to another server, :meth:`MessageRouter.add_forwarder`) gets the
  whole message as it came in, when the link's producer (seed 001) lets it through.  The
  producer decides on the chains its peer asked for; their tests join the plans below,
  so its decision is cached with the rest.  A message that came in over a link is not
  sent back over it: the :class:`~dataspace.dataspace.Encoded` run carries the
  forwarders to skip (``skip``).

Canonical form
--------------
Two encodings of one value must reach the same observers with the same captures.  Only
canonical encodings are routed on bytes: minimal integers and lengths, sets and
dictionaries sorted by the encodings of their elements and keys, no annotations, no
embedded references (those need the relay's membrane).  Canonical encodings are equal
exactly when the values are, so keys built from them are exact.  Any other encoding is
decoded and routed through the index like an in-process message, and what a subscriber
receives is then encoded canonically: the same bytes either way.

Exactness of the cache
----------------------
For every class of message (a record's label, sequences, dictionaries, atoms), the router
keeps a *plan*: every path any message-hearing pattern of that class (or of no class:
``$x``, ``_``) tests, with the strongest test made there -- the value (a constant), the
class (a nested compound) or mere existence (a capture, a discard).  A message's key
holds, for each path of its class's plan, the encoding, the class or the presence of what
is there.  Everything the index decides depends only on those, so two messages with the
same key have the same observers.  Any change to the message-hearing handlers of a class
(an observer added or removed) invalidates that class's entries (a generation count); a
change to handlers of no class invalidates every class.  Entries are bounded in number
and in bytes; the oldest go first.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from ..dataspace import Dataspace, Encoded, Subscription, _EntityObserver
from ..pattern import Arr, Bind, Dict, Discard, Lit, Pattern, Rec
from ..values import Embedded, Value, encode
from ..values.binary import DEFAULT_MAX_DEPTH, make_reader
from .upstream import Chain, chain_key

__all__ = [
    "CacheStats",
    "MessageRouter",
    "chain_info",
    "is_canonical",
    "scan",
    "scan_rel",
    "skip",
]

log = logging.getLogger(__name__)

EXIST = 1
"""Plan mode: only whether something is at the path."""
CLASS = 2
"""Plan mode: the class of what is there (a record's label, sequence, dictionary)."""
VALUE = 3
"""Plan mode: the encoding of what is there."""

MAX_DEPTH = DEFAULT_MAX_DEPTH

# ---------------------------------------------------------------------------------------
# Scanning canonical encodings


def _varint(buf: bytes, p: int, n: int) -> tuple[int, int]:
    """The canonical (minimal) varint at ``buf[p]``: (value, end), or (-1, -1)."""
    result = 0
    shift = 0
    start = p
    while p < n:
        b = buf[p]
        p += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            if b == 0 and p - start > 1:
                return -1, -1  # a trailing zero group: not minimal
            return result, p
        shift += 7
        if shift >= 70:
            return -1, -1
    return -1, -1


def skip(buf: bytes, p: int, depth: int) -> int:
    """The end of the value at ``buf[p]`` if its encoding is canonical and holds no
    annotation and no embedded value, else -1 (also when ``buf`` ends first or the value
    is nested deeper than the codec's limit, counting from ``depth``)."""
    n = len(buf)
    if p >= n:
        return -1
    tag = buf[p]
    if 0xB0 <= tag <= 0xB3:
        if p + 1 >= n:
            return -1
        ln = buf[p + 1]
        if ln < 0x80:
            s = p + 2
        else:
            ln, s = _varint(buf, p + 1, n)
            if s < 0:
                return -1
        e = s + ln
        if e > n:
            return -1
        if tag == 0xB0:
            if ln == 0:
                return e
            b0 = buf[s]
            if ln == 1:
                return e if b0 != 0 else -1
            b1 = buf[s + 1]
            if (b0 == 0 and b1 < 0x80) or (b0 == 0xFF and b1 >= 0x80):
                return -1
            return e
        if tag == 0xB2:
            return e
        raw = buf[s:e]
        if not raw.isascii():
            try:
                raw.decode()
            except UnicodeDecodeError:
                return -1
        return e
    if 0xB4 <= tag <= 0xB7:
        if depth >= MAX_DEPTH:
            return -1
        d1 = depth + 1
        p += 1
        count = 0
        ps = -1  # start and end of the previous element or key (sets, dictionaries)
        pe = -1
        while True:
            if p >= n:
                return -1
            t = buf[p]
            if t == 0x84:
                break
            q = skip(buf, p, d1)
            if q < 0:
                return -1
            if tag == 0xB6 or (tag == 0xB7 and not count & 1):
                if ps >= 0 and not buf[ps:pe] < buf[p:q]:
                    return -1  # out of order, or a duplicate
                ps = p
                pe = q
            count += 1
            p = q
        if tag == 0xB4 and count == 0:
            return -1  # a record needs a label
        if tag == 0xB7 and count & 1:
            return -1
        return p + 1
    if tag == 0x80 or tag == 0x81:
        return p + 1
    if tag == 0x87:
        if p + 10 <= n and buf[p + 1] == 8:
            return p + 10
        return -1
    return -1  # 0x84 where a value belongs, an annotation, an embedded value, a bad tag


def _utf8(buf: bytes, s: int, e: int) -> bool:
    try:
        buf[s:e].decode()
    except UnicodeDecodeError:
        return False
    return True


def _is_compiled() -> bool:
    """True when this module runs compiled: its functions then carry no Python code (as
    in values.model and pattern)."""
    return not hasattr(_is_compiled, "__code__")


COMPILED: Final = _is_compiled()
"""Whether this module is the compiled build of its source: loops over bytes pay there,
and in pure Python a C method doing the same is faster."""


def scan(buf: bytes, p: int, depth: int) -> list[int] | None:
    """Check the value at ``buf[p]`` as :func:`skip` does, and return its offsets:
    ``[start, item offsets..., close, end]`` -- for a record, sequence, set or
    dictionary where each of its items starts (a record's first item is its label, a
    dictionary's items are its keys and values in turn) and where its end marker is
    (item ``i`` is ``buf[offsets[i + 1]:offsets[i + 2]]``); for an atom
    ``[start, end, end]``.  None when it is not canonical (or not complete)."""
    items = scan_rel(buf, p, depth)
    if items is None:
        return None
    return [p] + [p + x for x in items[1:]]


def scan_rel(buf: bytes, p: int, depth: int) -> list[int] | None:
    """:func:`scan`, with every offset but the first (the start) relative to the start:
    the form :class:`~dataspace.dataspace.Encoded` keeps (a message's offsets are then
    small integers, which Python does not allocate)."""
    if p >= len(buf):
        return None
    tag = buf[p]
    if tag != 0xB4 and tag != 0xB5:
        if tag == 0xB6 or tag == 0xB7:
            return _scan_ordered(buf, p, depth)
        e = skip(buf, p, depth)
        return None if e < 0 else [p, e - p, e - p]
    if depth >= MAX_DEPTH:
        return None
    d1 = depth + 1
    start = p
    items: list[int] = [p]
    p += 1
    try:
        while True:
            t = buf[p]
            if t == 0x84:
                break
            # Short strings, symbols and integers are checked here; the rest by skip().
            # (A length running past the end shows at the next tag: IndexError.)
            if t == 0xB1 or t == 0xB3:
                ln = buf[p + 1]
                if ln < 0x80:
                    q = p + 2 + ln
                    if ln <= 24 and COMPILED:
                        # Short: looked at in place (compiled, a tight loop; no copy).
                        i = p + 2
                        while i < q and buf[i] < 0x80:
                            i += 1
                        if i < q and not _utf8(buf, p + 2, q):
                            return None
                    elif not buf[p + 2:q].isascii() and not _utf8(buf, p + 2, q):
                        return None
                else:
                    q = skip(buf, p, d1)
                    if q < 0:
                        return None
            elif t == 0xB0:
                ln = buf[p + 1]
                if ln < 0x80:
                    q = p + 2 + ln
                    if ln:
                        b0 = buf[p + 2]
                        if ln == 1:
                            if b0 == 0:
                                return None  # zero is written with no bytes
                        elif (b0 == 0 and buf[p + 3] < 0x80) or (b0 == 0xFF and buf[p + 3] >= 0x80):
                            return None  # not minimal
                else:
                    q = skip(buf, p, d1)
                    if q < 0:
                        return None
            else:
                q = skip(buf, p, d1)
                if q < 0:
                    return None
            items.append(p - start)
            p = q
    except IndexError:
        return None
    if tag == 0xB4 and len(items) == 1:
        return None  # a record needs a label
    items.append(p - start)
    items.append(p + 1 - start)
    return items


def _scan_ordered(buf: bytes, p: int, depth: int) -> list[int] | None:
    """:func:`scan_rel` of a set or dictionary (elements, keys in canonical order)."""
    tag = buf[p]
    if depth >= MAX_DEPTH:
        return None
    d1 = depth + 1
    start = p
    items: list[int] = [p]
    p += 1
    ps = -1
    pe = -1
    n = len(buf)
    while True:
        if p >= n:
            return None
        if buf[p] == 0x84:
            break
        q = skip(buf, p, d1)
        if q < 0:
            return None
        if tag == 0xB6 or len(items) & 1:
            if ps >= 0 and not buf[ps:pe] < buf[p:q]:
                return None  # out of order, or a duplicate
            ps = p
            pe = q
        items.append(p - start)
        p = q
    if tag == 0xB7 and not len(items) & 1:
        return None  # a key without a value
    items.append(p - start)
    items.append(p + 1 - start)
    return items


def is_canonical(data: bytes) -> bool:
    """Whether ``data`` is exactly one value in canonical form, without annotations or
    embedded values (what the router routes on its bytes)."""
    return skip(data, 0, 0) == len(data)


# ---------------------------------------------------------------------------------------
# What patterns test, as paths over encodings
#
# A path is a tuple of steps; a step is (tag of the compound, item): for a record (0xB4)
# the item index (the label is item 0, field i is item i + 1), for a sequence (0xB5) the
# element index, for a dictionary (0xB7) the canonical encoding of the key.

Step = tuple[int, Any]
Path = tuple[Step, ...]


class PatternInfo:
    """What one pattern tests, over encodings: its class (the encoding of a root
    record's label; ``b"\\xb5"`` and ``b"\\xb7"`` for sequences and dictionaries; None for
    a pattern of no class, matching any message), the tests ``(path, mode, expected)``
    and the capture paths in binding order.  ``never``: it can match no message routed on
    bytes (it holds an embedded constant, or an unencodable label)."""

    __slots__ = ("captures", "cls", "never", "tests")

    def __init__(self, pattern: Pattern) -> None:
        self.tests: list[tuple[Path, int, Any]] = []
        self.captures: list[Path] = []
        self.never = False
        p = pattern
        while type(p) is Bind:
            p = p.pattern  # type: ignore[attr-defined]
        t = type(p)
        self.cls: bytes | None = None
        try:
            if t is Rec:
                self.cls = encode(p.label)  # type: ignore[attr-defined]
            elif t is Arr:
                self.cls = b"\xb5"
            elif t is Dict:
                self.cls = b"\xb7"
            self._walk(pattern, ())
        except (TypeError, ValueError):
            self.never = True  # an embedded (or unencodable) label, key or constant

    def _walk(self, p: Pattern, path: Path) -> None:
        t = type(p)
        if t is Discard:
            if path:
                self.tests.append((path, EXIST, None))
        elif t is Bind:
            self.captures.append(path)
            if path:
                self.tests.append((path, EXIST, None))
            self._walk(p.pattern, path)  # type: ignore[attr-defined]
        elif t is Lit:
            v = p.value  # type: ignore[attr-defined]
            if _has_embedded(v):
                raise TypeError("embedded constant")
            self.tests.append((path, VALUE, encode(v)))
        elif t is Rec:
            if path:
                self.tests.append((path, CLASS, b"\xb4" + encode(p.label)))  # type: ignore[attr-defined]
            for i, sub in p.fields:  # type: ignore[attr-defined]
                self._walk(sub, (*path, (0xB4, i + 1)))
        elif t is Arr:
            if path:
                self.tests.append((path, CLASS, b"\xb5"))
            for i, sub in p.items:  # type: ignore[attr-defined]
                self._walk(sub, (*path, (0xB5, i)))
        elif t is Dict:
            if path:
                self.tests.append((path, CLASS, b"\xb7"))
            for k, sub in p.entries:  # type: ignore[attr-defined]
                self._walk(sub, (*path, (0xB7, encode(k))))
        else:
            raise TypeError(f"not a pattern: {p!r}")


def _has_embedded(v: Value) -> bool:
    if type(v) is Embedded:
        return True
    try:
        encode(v)
    except TypeError:
        return True
    return False


def chain_info(chain: Chain) -> PatternInfo | None:
    """What a link producer's ``chain`` (:mod:`dataspace.protocol.upstream`) tests, as a
    :class:`PatternInfo` capturing the whole message: a record, sequence or dictionary
    constraint tests the class there, an atom the encoding.  None when it can match no
    message routed on bytes (a constraint under an atom or a dictionary, whose
    container is not constrained first, or on an embedded value)."""
    info = PatternInfo(_WHOLE)
    kinds: dict[tuple[int, ...], Any] = {}
    steps: dict[tuple[int, ...], Path] = {(): ()}
    for path, item in chain:
        kind = item[0]
        try:
            if kind == "rec":
                enc: bytes = encode(item[2])
            elif kind == "lit":
                enc = encode(item[2])
                if _has_embedded(item[2]):
                    return None
            else:
                enc = b""
        except (TypeError, ValueError):
            return None
        if path:
            up = path[:-1]
            parent = kinds.get(up)
            if parent == "rec":
                rpath: Path = (*steps[up], (0xB4, path[-1] + 1))
            elif parent == "arr":
                rpath = (*steps[up], (0xB5, path[-1]))
            else:
                return None
            steps[path] = rpath
        else:
            rpath = ()
        kinds[path] = kind
        if kind == "rec":
            if rpath:
                info.tests.append((rpath, CLASS, b"\xb4" + enc))
            elif info.cls is None or info.cls == enc:
                info.cls = enc
            else:
                return None  # two labels at the root
        elif kind == "arr" or kind == "dict":
            c = b"\xb5" if kind == "arr" else b"\xb7"
            if rpath:
                info.tests.append((rpath, CLASS, c))
            elif info.cls is None or info.cls == c:
                info.cls = c
            else:
                return None
        else:
            info.tests.append((rpath, VALUE, enc))
    return info


def class_of(buf: bytes, s: int, e: int) -> bytes:
    """The class of the (canonical) value ``buf[s:e]``: ``b"\\xb4"`` and its label's
    encoding for a record, ``b"\\xb5"`` / ``b"\\xb7"`` for a sequence / dictionary (a set
    is ``b"\\xb6"``), ``b""`` for an atom."""
    t = buf[s]
    if t == 0xB4:
        return b"\xb4" + buf[s + 1:skip(buf, s + 1, 0)]
    if 0xB5 <= t <= 0xB7:
        return buf[s:s + 1]
    return b""


def resolve(buf: bytes, s: int, e: int, path: Path,
            memo: dict[int, Any] | None = None) -> tuple[int, int] | None:
    """The span of the value at ``path`` inside the (canonical) value ``buf[s:e]``, or
    None when there is none.  ``memo`` keeps what was learnt of each compound on the way
    (its items; a dictionary's keys), so that resolving many paths of one message scans
    each compound once."""
    for tag, item in path:
        if buf[s] != tag:
            return None
        got = memo.get(s) if memo is not None else None
        if got is None:
            items = scan(buf, s, 0)
            if items is None:  # pragma: no cover - checked as a whole already
                return None
            keys: dict[bytes, int] | None = None
            if tag == 0xB7:
                keys = {buf[items[j]:items[j + 1]]: j + 1 for j in range(1, len(items) - 3, 2)}
            got = (items, keys)
            if memo is not None:
                memo[s] = got
        items, keys = got
        if keys is not None:
            found = keys.get(item, -1)
            if found < 0:
                return None
            s, e = items[found], items[found + 1]
        else:
            if item >= len(items) - 3:
                return None
            s, e = items[item + 1], items[item + 2]
    return (s, e)


# ---------------------------------------------------------------------------------------
# The match cache


class _Class:
    """The routing state of one class of messages: its plan and generation."""

    __slots__ = ("counts", "gen", "index", "key_modes", "keys", "plan", "simple", "top")

    def __init__(self) -> None:
        self.counts: dict[tuple[Path, int], int] = {}  # (path, mode) -> patterns testing it
        self.plan: list[tuple[Path, int]] = []  # path, strongest mode; sorted
        self.index: dict[Path, int] = {}  # path -> its position in the plan
        # When every path of the plan is an item of the outermost compound: for each
        # plan path its item index (-1: the value itself); else None.
        self.simple: list[int] | None = []
        self.key_modes: list[tuple[int, int]] = []  # (item, mode) of VALUE/CLASS paths
        self.top = 0  # the key counts items up to this many (one past the highest tested)
        self.gen = 0
        self.keys: dict[tuple[Any, ...], None] = {}  # keys of the entries kept for it


class _Entry:
    """A cached answer: the deliveries of one key, for one generation of its class.

    ``groups`` has one element per matching handler, in the index's order:
    ``(where, sinks, observers, others)`` -- where the captures are (pairs of positions
    in a message's offsets list, adjacent captures merged; or, when the class's plan is
    not *simple*, plan positions), the remote observers as ``(observer, relay, oid)``
    and as observers, and the other callbacks (which get decoded captures through the
    dataspace's queue).  ``fallback``: the captures could not be placed (a bug); the
    message then goes through the index.
    """

    __slots__ = ("alt", "count", "cs", "fallback", "fast", "fws", "gen", "groups", "queued",
                 "simple", "size")

    def __init__(self, cs: _Class, groups: list[tuple[Any, ...]], count: int, size: int,
                 fallback: bool = False, fws: tuple[Any, ...] = ()) -> None:
        self.cs = cs
        self.fws = fws  # the forwarders among the deliveries (see MessageRouter.add_forwarder)
        self.alt: tuple[Any, _Entry] | None = None  # (skip, this entry without those)
        self.gen = cs.gen
        self.groups = groups
        self.count = count  # callbacks reached (what a turn's metering counts)
        self.queued = False  # some callback needs the queue
        self.simple = cs.simple is not None
        self.size = size
        self.fallback = fallback
        self.fast: tuple[int, int, tuple[Any, ...]] | None = None
        self.refresh()

    def refresh(self) -> None:
        """Recompute the derived fields after ``groups`` changed."""
        self.alt = None
        groups = self.groups
        self.queued = any(g[3] for g in groups)
        # The common case in a form quick to use: every match a remote observer whose
        # captures are one span of the message (the same one): (start, end, sinks).
        self.fast = None
        if groups and self.simple and not self.fallback and not self.queued:
            w = groups[0][0]
            if len(w[0]) == 1 and all(g[0] is w for g in groups):
                a, b = w[0][0]
                self.fast = (a, b, tuple(x for g in groups for x in g[1]))


    def without(self, skip: tuple[Any, ...]) -> _Entry:
        """This entry without the deliveries to the forwarders in ``skip`` (a message
        that came in over a link does not go back over it); kept for the next message
        from there."""
        alt = self.alt
        if alt is not None and alt[0] is skip:
            return alt[1]
        groups: list[tuple[Any, ...]] = []
        fws: list[Any] = []
        count = self.count
        for g in self.groups:
            obs = g[2]
            if len(obs) == 1 and obs[0] in self.fws:
                if obs[0] in skip:
                    count -= 1
                    continue
                fws.append(obs[0])
            groups.append(g)
        e = _Entry(self.cs, groups, count, self.size, self.fallback, tuple(fws))
        self.alt = (skip, e)
        return e


class CacheStats:
    """Counters of a :class:`MessageRouter` (for monitoring)."""

    __slots__ = ("evictions", "fallbacks", "hits", "invalidations", "misses", "routed")

    def __init__(self) -> None:
        self.routed = 0  # messages routed on their bytes
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.invalidations = 0  # classes whose entries a handler change made stale
        self.fallbacks = 0  # messages that had to go through the index after all


MAX_ENTRIES = 8192
"""Entries kept at most (the oldest go first)."""
MAX_BYTES = 8 << 20
"""Bytes of keys and deliveries kept at most (an estimate)."""
PATCH_MAX = 512
"""A class with more entries than this is invalidated, not updated in place, when a
remote observer joins or leaves it."""
MAX_KEY = 1024
"""Keys longer than this (in bytes of encodings) are not kept: such messages are routed
through the index each time."""

_read_plain = make_reader(False, None, MAX_DEPTH)

_WHOLE = Bind(Discard())
_WHOLE_INFO = PatternInfo(_WHOLE)
"""Where a forwarder's capture is: the whole message."""

_B_SEQ = b"\xb5"
_B_END = b"\x84"


class MessageRouter:
    """Routes :class:`~dataspace.dataspace.Encoded` messages of a dataspace on their
    bytes (see the module docstring).  Making one installs it: the dataspace hands it
    every encoded message, and its index tells it of every change of message-hearing
    handlers."""

    def __init__(self, ds: Dataspace, *, max_entries: int = MAX_ENTRIES,
                 max_bytes: int = MAX_BYTES) -> None:
        self.ds = ds
        self.index = ds.index
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._classes: dict[bytes, _Class] = {}
        self._root = _Class()  # patterns of no class; and the plan of classes without any
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._bytes = 0
        self._infos: dict[Pattern, PatternInfo] = {}
        self._gen = 0
        self._fws: list[Any] = []  # forwarders (see add_forwarder), in the order added
        self._fw_chains: dict[int, dict[Any, PatternInfo]] = {}  # id(fw) -> chains counted
        # Handlers installed before the router: count them in.
        for pattern, n in self.index.message_patterns():
            self._changed(n, pattern)
        self.index.listener = self._changed
        ds.router = self

    # -- plans -------------------------------------------------------------------------

    def _info(self, pattern: Pattern) -> PatternInfo:
        info = self._infos.get(pattern)
        if info is None:
            info = PatternInfo(pattern)
            if len(self._infos) > 4096:
                self._infos.clear()
            self._infos[pattern] = info
        return info

    def _changed(self, delta: int, pattern: Pattern, callback: Any = None) -> None:
        """The index gained (``delta`` > 0) or lost message-hearing callbacks for
        ``pattern``: a remote observer joining or leaving is added to or removed from
        the entries of its class (the plan still covers what it tests); any other change
        makes them stale."""
        self._changed_info(delta, self._info(pattern), callback)

    def _changed_info(self, delta: int, info: PatternInfo, callback: Any) -> None:
        if info.never:
            return  # it matches no message routed on bytes: nothing to invalidate
        if info.cls is None:
            self._count(self._root, info, delta)
            for each in self._classes.values():
                self._replan(each)
            self._replan(self._root)
            self.stats.invalidations += 1 + len(self._classes)
            return
        got = self._classes.get(info.cls)
        new = got is None
        if got is None:
            got = self._classes[info.cls] = _Class()
        cs = got
        self._count(cs, info, delta)
        if not cs.counts:
            del self._classes[info.cls]
            self._gen += 1
            cs.gen = self._gen  # entries holding it are stale
            self.stats.invalidations += 1
            return
        # (A new class's plan starts from the patterns of no class: what they test and
        # capture is in every plan, even when this one tests nothing.)
        if new or (delta > 0 and not _covered(cs, info)):
            self._replan(cs)
            self.stats.invalidations += 1
            return
        # (A plan that tests more than its patterns need is still exact: removals keep it.)
        sink = _sink_of(callback) if abs(delta) == 1 else None
        if sink is None:
            self._gen += 1
            cs.gen = self._gen
            self.stats.invalidations += 1
            return
        if len(cs.keys) > PATCH_MAX:
            # Updating this many entries would cost each subscription more than the
            # misses that recomputing the ones in use will (a peer adding observers by
            # the thousand must not make the server evaluate them against every key).
            self._gen += 1
            cs.gen = self._gen
            self.stats.invalidations += 1
        elif cs.keys:
            self._patch(cs, info, sink, delta)

    def _stale(self, cls: bytes | None) -> None:
        """Every entry of the class ``cls`` (None: of every class) is stale."""
        self._gen += 1
        self.stats.invalidations += 1
        if cls is None:
            for cs in self._classes.values():
                cs.gen = self._gen
            self._root.gen = self._gen
        else:
            got = self._classes.get(cls)
            if got is not None:
                got.gen = self._gen

    # -- forwarders --------------------------------------------------------------------

    def add_forwarder(self, fw: Any, chains: list[Chain]) -> None:
        """Have ``fw`` (a link's sink: see :class:`dataspace.broker.link`) hear every
        message its ``decide(value)`` accepts, as the message's bytes: ``fw`` takes the
        calls a relay does (``emit_run(head, parts)``, ``emit_captures(head, parts,
        size)``), a queued observer's (``deliver_body(body)``, the body being
        ``[message]``) and ``seen(n)`` for every ``n`` messages routed here that did not
        come from it; it has a ``delivered`` count.  ``decide`` must depend only on
        which of the ``chains`` hold on the message (a link producer's entries, positive
        and negative): their tests join the plans, so decisions are cached exactly.  Tell
        :meth:`forwarder_changed` of every change of those chains."""
        if any(f is fw for f in self._fws):
            return
        self._fws.append(fw)
        self._fw_chains[id(fw)] = {}
        for chain in chains:
            self.forwarder_changed(fw, chain, True)
        self._stale(None)

    def remove_forwarder(self, fw: Any) -> None:
        """``fw`` hears nothing from now on."""
        counted = self._fw_chains.pop(id(fw), None)
        if counted is None:
            return
        self._fws = [f for f in self._fws if f is not fw]
        for info in counted.values():
            self._changed_info(-1, info, None)
        self._stale(None)

    def forwarder_changed(self, fw: Any, chain: Chain, present: bool) -> None:
        """The entry of ``chain`` in what ``fw`` decides on changed: it is there
        (``present``: added, or its decision changed) or gone; the entries of the
        messages it tests are recomputed."""
        counted = self._fw_chains.get(id(fw))
        if counted is None:
            return
        k = chain_key(chain)
        info = counted.get(k)
        if present and info is None:
            got = chain_info(chain)
            if got is None:
                return  # it matches no message routed here: no decision depends on it
            counted[k] = got
            self._changed_info(1, got, None)
        elif not present and info is not None:
            del counted[k]
            self._changed_info(-1, info, None)
        elif info is not None:
            self._stale(info.cls)

    @property
    def forwarders(self) -> int:
        """How many forwarders hear messages here."""
        return len(self._fws)

    def _patch(self, cs: _Class, info: PatternInfo, sink: tuple[Any, ...], delta: int) -> None:
        """Add (``delta`` 1) or remove (-1) the remote observer ``sink`` to or from the
        current entries of ``cs`` whose messages its pattern ``info`` matches."""
        entries = self._entries
        gen = cs.gen
        cb = sink[0]
        if delta > 0:
            w = self._placement(cs, info)
            if w is None:  # pragma: no cover - covered plans place every capture
                self._gen += 1
                cs.gen = self._gen
                return
        for key in cs.keys:
            e = entries.get(key)
            if e is None or e.gen != gen or e.cs is not cs:
                continue
            if delta > 0:
                if not _matches_key(cs, info, key):
                    continue
                for g in e.groups:
                    if g[0] == w:
                        w = g[0]  # one object for equal placements (see Entry.fast)
                        break
                e.groups.append((w, (sink,), (cb,), ()))
                e.count += 1
                e.size += 80
                self._bytes += 80
                e.refresh()
            else:
                groups = []
                found = False
                for g in e.groups:
                    if any(o is cb for o in g[2]):
                        found = True
                        obs = tuple(o for o in g[2] if o is not cb)
                        if obs or g[3]:
                            groups.append((g[0], tuple(x for x in g[1] if x[0] is not cb),
                                           obs, g[3]))
                    else:
                        groups.append(g)
                if found:
                    e.groups = groups
                    e.count -= 1
                    e.refresh()

    def _placement(self, cs: _Class, info: PatternInfo) -> tuple[Any, Any] | None:
        """Where the captures of ``info`` are in a message of ``cs`` (see _Entry)."""
        pos = cs.index
        simple = cs.simple
        where: list[Any] = []
        each: list[Any] = []
        for path in info.captures:
            i = pos.get(path)
            if i is None:
                return None
            if simple is None:
                where.append(i)
                each.append(i)
                continue
            item = simple[i]
            lo, hi = (0, -1) if item < 0 else (item + 1, item + 2)
            each.append((lo, hi))
            if where and where[-1][1] == lo and lo > 0:
                where[-1] = (where[-1][0], hi)  # adjacent fields: one span
            else:
                where.append((lo, hi))
        return (tuple(where), tuple(each))

    def _count(self, cs: _Class, info: PatternInfo, delta: int) -> None:
        counts = cs.counts
        for path, mode, _x in info.tests:
            k = (path, mode)
            n = counts.get(k, 0) + delta
            if n > 0:
                counts[k] = n
            else:
                counts.pop(k, None)
        for path in info.captures:
            if not path:
                k = ((), EXIST)  # a capture of the whole message: the plan must say so
                n = counts.get(k, 0) + delta
                if n > 0:
                    counts[k] = n
                else:
                    counts.pop(k, None)
        k = ((), 0)  # the patterns themselves, so that a class with none is dropped
        n = counts.get(k, 0) + delta
        if n > 0:
            counts[k] = n
        else:
            counts.pop(k, None)

    def _replan(self, cs: _Class) -> None:
        strongest: dict[Path, int] = {}
        for counts in (cs.counts, self._root.counts) if cs is not self._root else (cs.counts,):
            for (path, mode), _n in counts.items():
                if mode and strongest.get(path, 0) < mode:
                    strongest[path] = mode
        plan = sorted(strongest.items(), key=lambda pm: _path_order(pm[0]))
        cs.plan = plan
        cs.index = {p: i for i, (p, _m) in enumerate(plan)}
        simple: list[int] | None = []
        key_modes: list[tuple[int, int]] = []
        top = 0
        for path, mode in plan:
            if not path:
                if mode != EXIST or simple is None:
                    simple = None
                else:
                    simple.append(-1)
                continue
            if len(path) != 1 or type(path[0][1]) is not int or simple is None:
                simple = None
                continue
            item = path[0][1]
            simple.append(item)
            top = max(top, item + 1)
            if mode != EXIST:
                key_modes.append((item, mode))
        cs.simple = simple
        cs.key_modes = key_modes
        cs.top = top
        self._gen += 1
        cs.gen = self._gen

    # -- routing -----------------------------------------------------------------------

    def prepare(self, enc: Encoded, lo: int = 0, hi: int = -1) -> tuple[list[_Entry], int]:
        """The deliveries of each message of ``enc`` (of ``enc.msgs[lo:hi]``; ``hi`` -1:
        to the end) from the cache, or computed and cached, and how many callbacks they
        reach in all; nothing is delivered yet."""
        buf = enc.buf
        classes = self._classes
        entries = self._entries
        root = self._root
        out: list[_Entry] = []
        cost = 0
        hits = 0
        last_ck = None
        cs = root
        simple: list[int] | None = None
        top = 0
        km: list[tuple[int, int]] = []
        one = -1  # the item of the one VALUE test of the plan, if that is all it has
        gen = 0
        last_n = -1  # (a class whose plan tests no value: the key of the message before,
        last_e: Any = None  # and its entry)
        msgs = enc.msgs if lo == 0 and hi < 0 else enc.msgs[lo:hi if hi >= 0 else None]
        for items in msgs:
            s = items[0]  # (the offsets after it are relative to it: see scan_rel)
            t = buf[s]
            if t == 0xB4:
                ck = buf[s + items[1]:s + items[2]]
            elif 0xB5 <= t <= 0xB7:
                ck = buf[s:s + 1]
            else:
                ck = b""
            if ck != last_ck:
                last_ck = ck
                cs = classes.get(ck, root)
                simple = cs.simple
                top = cs.top
                km = cs.key_modes
                one = km[0][0] if len(km) == 1 and km[0][1] == VALUE else -1
                gen = cs.gen
                last_n = -1
            key: tuple[Any, ...]
            if simple is not None:
                # Items of the outermost compound only: the key is the class, how many
                # items there are (up to the highest the plan looks at) and the
                # encodings (or classes) of the items tested against constants or shapes.
                n = len(items) - 3  # how many items it has
                if n > top:
                    n = top
                if not km:
                    if n == last_n:  # the same key as the message before
                        out.append(last_e)
                        cost += last_e.count
                        hits += 1
                        continue
                    key = (last_ck, n)
                elif one >= 0:
                    key = (ck, n, buf[s + items[one + 1]:s + items[one + 2]]) if one < n \
                        else (ck, n)
                else:
                    parts: list[Any] = [ck, n]
                    for item, mode in km:
                        if item < n:
                            if mode == VALUE:
                                parts.append(buf[s + items[item + 1]:s + items[item + 2]])
                            else:
                                parts.append(class_of(buf, s + items[item + 1],
                                                      s + items[item + 2]))
                    key = tuple(parts)
            else:
                key = self._general_key(buf, items, cs, ck)
            e = entries.get(key)
            if e is None or e.gen != gen or e.cs is not cs:
                e = self._miss(buf, items, cs, key)
            else:
                hits += 1
            out.append(e)
            cost += e.count
            if not km and simple is not None:
                last_n = n
                last_e = e
        self.stats.hits += hits
        return out, cost

    def _general_key(self, buf: bytes, items: list[int], cs: _Class,
                     ck: bytes) -> tuple[Any, ...]:
        s = items[0]
        e = s + items[-1]
        parts: list[Any] = [ck]
        memo: dict[int, Any] = {}
        for path, mode in cs.plan:
            sp = resolve(buf, s, e, path, memo)
            if sp is None:
                parts.append(None)
            elif mode == EXIST:
                parts.append(True)
            elif mode == VALUE:
                parts.append(buf[sp[0]:sp[1]])
            else:
                parts.append(class_of(buf, sp[0], sp[1]))
        return tuple(parts)

    def _miss(self, buf: bytes, items: list[int], cs: _Class, key: tuple[Any, ...]) -> _Entry:
        self.stats.misses += 1
        groups: list[tuple[Any, ...]] = []
        count = 0
        size = 64
        value = _read_plain(buf, items[0], 0)[0]
        fallback = False
        shared: dict[Any, Any] = {}  # equal capture placements as one object (see emit)
        for handler, mcbs in self.index.message_matches(value):
            count += len(mcbs)
            w = self._placement(cs, self._info(handler.pattern))
            if w is None:  # pragma: no cover - every capture path is in the plan
                log.warning("route: a capture path is missing from its class's plan")
                fallback = True
                break
            w = shared.setdefault(w, w)
            sinks: list[Any] = []
            observers: list[Any] = []
            others: list[Any] = []
            for cb in mcbs:
                sink = _sink_of(cb)
                if sink is not None:
                    sinks.append(sink)
                    observers.append(cb)
                elif type(cb) is not Subscription or cb.on_message is not None:
                    others.append(cb)  # (a subscription without on_message: nothing to do)
            groups.append((w, tuple(sinks), tuple(observers), tuple(others)))
            size += 64 + 16 * len(mcbs)
        fws: list[Any] = []
        if self._fws and not fallback:
            ww: Any = None
            for fw in self._fws:
                if not fw.decide(value):
                    continue
                if ww is None:
                    ww = self._placement(cs, _WHOLE_INFO)
                    if ww is None:  # pragma: no cover - a forwarder's chains capture it
                        log.warning("route: the whole message is missing from its plan")
                        fallback = True
                        break
                    ww = shared.setdefault(ww, ww)
                fws.append(fw)
                groups.append((ww, ((fw, fw, b""),), (fw,), ()))
                count += 1
                size += 80
        key_bytes = 0
        for x in key:
            if type(x) is bytes:
                key_bytes += len(x)
        size += key_bytes + 40 * len(key)
        if fallback:
            return _Entry(cs, [], count, size, True)
        entry = _Entry(cs, groups, count, size, False, tuple(fws))
        if key_bytes <= MAX_KEY:
            self._keep(key, entry)
        return entry

    def _keep(self, key: tuple[Any, ...], entry: _Entry) -> None:
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self._bytes -= old.size
            old.cs.keys.pop(key, None)
        entries[key] = entry
        entry.cs.keys[key] = None
        self._bytes += entry.size
        if len(entries) > self.max_entries or self._bytes > self.max_bytes:
            # Drop the oldest quarter (insertion order): cheap, and what is still wanted
            # comes back at its next miss.
            drop = max(1, len(entries) // 4)
            for k in list(entries)[:drop]:
                e = entries.pop(k)
                self._bytes -= e.size
                e.cs.keys.pop(k, None)
            self.stats.evictions += drop

    def emit(self, enc: Encoded, entries: list[_Entry], queue: Any, direct: bool,
             lo: int = 0) -> None:
        """Deliver the messages of ``enc`` as :meth:`prepare` found: remote observers
        get the received bytes of their captures (``[capture ...]``), at once when
        ``direct`` and ``queue`` (the dataspace's event queue) is empty, else through it
        in order; other callbacks get decoded captures through the queue.  ``entries``
        are those of ``enc.msgs[lo:]``."""
        buf = enc.buf
        self.stats.routed += len(entries)
        msgs = enc.msgs
        k = lo
        i = 0
        n = len(entries)
        if self._fws:
            skip = enc.skip
            for fw in self._fws:
                if skip is None or fw not in skip:
                    fw.seen(n)
            if skip is not None:
                entries = [e.without(skip) if e.fws else e for e in entries]
        while i < n:
            e = entries[i]
            fast = e.fast
            if fast is not None and direct and not queue:
                # Messages in a row with these same deliveries, one span each to remote
                # observers only: each observer's relay takes them all at once.
                j = i + 1
                while j < n and entries[j] is e:
                    j += 1
                a, b, sinks = fast
                if a:
                    parts = [buf[items[0] + items[a]:items[0] + items[b]]
                             for items in msgs[k:k + j - i]]
                else:  # (the whole message)
                    parts = [buf[items[0]:items[0] + items[b]] for items in msgs[k:k + j - i]]
                for o, relay, head in sinks:
                    o.delivered += j - i
                    relay.emit_run(head, parts)
                k += j - i
                i = j
                continue
            self._emit_one(buf, msgs[k], e, queue, direct)
            k += 1
            i += 1

    def _emit_one(self, buf: bytes, items: list[int], e: _Entry, queue: Any,
                  direct: bool) -> None:
        if e.fallback:  # pragma: no cover - see _miss
            self.stats.fallbacks += 1
            self.ds.index.send_message(_read_plain(buf, items[0], 0)[0])
            return
        spans: list[tuple[int, int] | None] | None = None
        last: Any = None
        parts: Any = ()
        size = 0
        s = items[0]  # (the other offsets are relative to it)
        for w, sinks, observers, others in e.groups:
            if w is not last:
                last = w
                where = w[0]
                if e.simple:
                    if len(where) == 1:
                        lo, hi = where[0]
                        part = buf[s + items[lo] if lo else s:s + items[hi]]
                        parts = (part,)
                        size = len(part)
                    else:
                        parts = tuple([buf[s + items[lo] if lo else s:s + items[hi]]
                                       for lo, hi in where])
                        size = sum(map(len, parts))
                else:
                    if spans is None:
                        spans = _spans(buf, items, e.cs)
                    parts = tuple([_span_bytes(buf, spans[i]) for i in where])
                    size = sum(map(len, parts))
            if sinks:
                if direct and not queue:
                    for o, relay, head in sinks:
                        o.delivered += 1
                        relay.emit_captures(head, parts, size)
                else:
                    queue.append(("b", observers, b"".join((_B_SEQ, *parts, _B_END))))
            if others:
                if e.simple:
                    caps = [_read_plain(buf, s + items[lo] if lo else s, 0)[0]
                            for lo, _hi in w[1]]
                else:
                    if spans is None:
                        spans = _spans(buf, items, e.cs)
                    caps = [_read_plain(buf, _span_start(spans[i]), 0)[0] for i in w[1]]
                queue.append(("!", others, tuple(caps)))

    def entries(self) -> int:
        """Entries in the cache now (stale ones included until they are replaced)."""
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (they come back at their next miss)."""
        for e in self._entries.values():
            e.cs.keys.clear()
        self._entries.clear()
        self._bytes = 0


def _sink_of(cb: Any) -> tuple[Any, Any, bytes] | None:
    """``(observer, relay, head)`` for an observer whose entity is a relay's proxy (its
    messages can be spliced into the relay's packets), else None."""
    if type(cb) is not _EntityObserver:
        return None
    ent = cb.entity
    relay = getattr(ent, "relay", None)
    head = getattr(ent, "msg_head", None)
    if getattr(relay, "emit_captures", None) is None or type(head) is not bytes \
            or getattr(ent, "send_body", None) is None:
        return None
    return (cb, relay, head)


def _covered(cs: _Class, info: PatternInfo) -> bool:
    """Whether the plan of ``cs`` tests everything ``info`` tests (at least as strongly)."""
    pos = cs.index
    plan = cs.plan
    for path, mode, _x in info.tests:
        i = pos.get(path)
        if i is None or plan[i][1] < mode:
            return False
    for path in info.captures:
        if path not in pos:
            return False
    return True


def _matches_key(cs: _Class, info: PatternInfo, key: tuple[Any, ...]) -> bool:
    """Whether the pattern ``info`` (whose tests the plan of ``cs`` covers) matches the
    messages whose key is ``key``."""
    plan = cs.plan
    pos = cs.index
    if cs.simple is not None:
        n = key[1]
        comps: dict[int, Any] = {}
        j = 2
        for item, _mode in cs.key_modes:
            if item < n:
                comps[item] = key[j]
                j += 1
        for path, mode, expected in info.tests:
            if not path:
                continue  # the message itself is there
            item = path[0][1]
            if item >= n:
                return False
            if mode == EXIST:
                continue
            comp = comps[item]
            if mode == VALUE or plan[pos[path]][1] == CLASS:
                if comp != expected:
                    return False
            elif class_of(comp, 0, len(comp)) != expected:
                return False
        return True
    for path, mode, expected in info.tests:
        i = pos[path]
        comp = key[1 + i]
        if comp is None:
            return False
        if mode == EXIST:
            continue
        if mode == VALUE or plan[i][1] == CLASS:
            if comp != expected:
                return False
        elif class_of(comp, 0, len(comp)) != expected:
            return False
    return True


def _spans(buf: bytes, items: list[int], cs: _Class) -> list[tuple[int, int] | None]:
    s0 = items[0]
    e0 = s0 + items[-1]
    memo: dict[int, Any] = {}
    return [resolve(buf, s0, e0, p, memo) for p, _m in cs.plan]


def _span_bytes(buf: bytes, sp: tuple[int, int] | None) -> bytes:
    assert sp is not None  # a capture of a match is always there
    return buf[sp[0]:sp[1]]


def _span_start(sp: tuple[int, int] | None) -> int:
    assert sp is not None
    return sp[0]


def _path_order(path: Path) -> tuple[Any, ...]:
    return tuple((tag, 0, item) if type(item) is int else (tag, 1, item) for tag, item in path)
