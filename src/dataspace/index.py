"""The skeleton index of seed 000: which handlers does an assertion or message concern?

Structure (names from the seed)::

    Index        = Bag(V) x Node (the root)
    Node         = Continuation x (Move -> Class -> Node)
    Continuation = cache of V x ((constant paths, check paths) -> constant values -> Leaf)
    Leaf         = cache of V x (capture paths -> Handler)

(Caches hold assertion ids, not values: ``Index.values`` maps each id to its value once.
Dictionaries of integers are invisible to Python's garbage collector, so filling many
leaves does not trigger full collections.)
    Handler      = Bag(captures) x callbacks

An assertion or message walks the trie of moves from the root, following the classes of
the value's compound positions (a record's label, "sequence" or "dictionary"), and at each
node's continuation looks up the constant values at that continuation's constant paths.
Matching is at-least-arity: extra fields, elements and keys are ignored, so the index
agrees exactly with :func:`dataspace.pattern.match`.

Beyond the seed:

* Projections (the values at constant, check and capture paths) are made once per
  constant group / capture map as small closures over the paths, with dedicated ones for
  fields of the outermost record (the seed's "JIT compilation of shapes, constant checks,
  captures", without generated code: the same source compiles ahead of time).
* Nothing is kept that no handler and no assertion needs: constant groups disappear with
  their last handler, leaves with their last handler and cached assertion, nodes with
  their last continuation entry and child.  After every handler and assertion is gone the
  index is back to its empty size (:meth:`Index.stats` shows it).
* Values are keyed by :func:`dataspace.values.key`, so ``1``, ``1.0`` and ``#t`` are three
  different assertions and three different constants.

Callbacks run synchronously, inside the operation that causes them, and must not modify
the index (queue the work instead -- :class:`dataspace.Dataspace` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .pattern import (
    DICTIONARY_CLASS,
    SEQUENCE_CLASS,
    Path,
    Pattern,
    Skeleton,
    apply_move,
    path_key,
    skeleton,
)
from .values import Dictionary, Record, Sequence, Symbol, Value, key, preserve, strip
from .values.model import _PLAIN, _PLAIN_NOINT

__all__ = ["Callback", "Index"]

Callback = Callable[[str, tuple[Value, ...]], Any]
"""``callback(event, captures)`` with event ``"+"``, ``"-"`` or ``"!"``."""

_tuple_getitem = tuple.__getitem__


class _Node:
    __slots__ = (
        "cls",
        "compiled",
        "cont",
        "kinds",
        "move_key",
        "move_list",
        "moves",
        "parent",
    )

    def __init__(
        self, parent: _Node | None, move_key: Any, cls: Any, kinds: dict[Path, str]
    ) -> None:
        self.cont = _Continuation()
        # move key -> (getter, up, {class -> node}); move_list mirrors it as a list of
        # (up, getter, class table) for fast iteration.
        self.moves: dict[Any, tuple[Callable[[Any], Any], int, dict[Any, _Node]]] = {}
        self.move_list: list[tuple[int, Callable[[Any], Any], dict[Any, _Node]]] = []
        self.parent = parent
        self.move_key = move_key
        self.cls = cls
        self.kinds = kinds
        # capture paths -> [compiled projection, handlers using it] (shared by every leaf
        # under this node; dropped with its last handler)
        self.compiled: dict[Any, list[Any]] = {}

    def rebuild_move_list(self) -> None:
        self.move_list = [(up, get, table) for (get, up, table) in self.moves.values()]


class _Continuation:
    __slots__ = ("cache", "has_msg", "table")

    def __init__(self) -> None:
        self.cache: dict[int, None] = {}  # ids of the assertions that reach here
        self.table: dict[Any, _ConstGroup] = {}
        self.has_msg = False  # some handler here hears messages

    def refresh_msg(self) -> None:
        self.has_msg = any(grp.msg for grp in self.table.values())


class _ConstGroup:
    """``table[(constant paths, check paths)]``: leaves by constant values."""

    __slots__ = ("leaves", "msg", "nhandlers", "project")

    def __init__(self, project: Callable[[Value], Any]) -> None:
        self.project = project
        self.leaves: dict[Any, _Leaf] = {}
        # What a message needs and nothing else: constant values -> flat tuple
        # (projection, callbacks, projection, callbacks, ...) of the handlers with
        # callbacks, so a message touches one dict and one tuple per match.
        self.msg: dict[Any, tuple[Any, ...]] = {}
        self.nhandlers = 0


class _Leaf:
    __slots__ = ("cache", "handlers", "hlist", "one")

    def __init__(self) -> None:
        # Ids of the assertions with these constants: the first in ``one``, any more in
        # ``cache`` (most leaves hold one assertion, and a dict costs an allocation).
        self.one: int | None = None
        self.cache: dict[int, None] = {}
        self.handlers: dict[Any, _Handler] = {}
        self.hlist: tuple[_Handler, ...] = ()  # handlers.values(), for fast iteration

    def refresh(self, grp: _ConstGroup, ck: Any) -> None:
        """Recompute the derived tuples after a handler or callback change."""
        self.hlist = tuple(self.handlers.values())
        flat: list[Any] = []
        for h in self.hlist:
            if h.mcbs:
                flat += (h.project, h.mcbs)
        if flat:
            grp.msg[ck] = tuple(flat)
        else:
            grp.msg.pop(ck, None)


_NO = object()  # "no entry" in a handler's first-entry slot


class _Handler:
    __slots__ = ("bag", "c1", "callbacks", "cbs", "extra", "k1", "mcbs", "pattern", "project")

    def __init__(self, project: Callable[[Value], Any], pattern: Pattern) -> None:
        self.project = project
        self.pattern = pattern  # the first pattern of this handler (all have its captures)
        # Bag of capture tuples, strict key -> captures: the first distinct entry in
        # ``k1``/``c1``, any more in ``bag`` (a dict costs an allocation, and many
        # handlers only ever hold one).  A count above one is kept in ``extra``
        # (key -> count - 1), so the common case allocates nothing.
        self.k1: Any = _NO
        self.c1: tuple[Any, ...] | None = None
        self.bag: dict[Any, tuple[Any, ...]] = {}
        self.extra: dict[Any, int] = {}
        self.callbacks: dict[Callback, bool] = {}  # callback -> hears messages
        self.cbs: tuple[Callback, ...] = ()  # the callbacks, as a tuple for firing
        self.mcbs: tuple[Callback, ...] = ()  # those that hear messages

    def set_callbacks(self) -> None:
        self.cbs = tuple(self.callbacks)
        self.mcbs = tuple(cb for cb, m in self.callbacks.items() if m)


# ---------------------------------------------------------------------------------------
# Projections: the values at a continuation's constant and check paths, and at a
# handler's capture paths.  Built once per constant group / capture map as closures over
# the paths (no generated code): paths into the fields of the outermost record -- most
# patterns' -- get dedicated ones, any other path a walk over its steps.

_REC = 0
_ARR = 1
_DICT = 2
_MISSING = object()


def _steps(kinds: dict[Path, str], path: Path) -> tuple[tuple[int, Any], ...]:
    """``path`` as (kind, step) pairs: field index, element index or strict key."""
    out = []
    for i, step in enumerate(path):
        kind = kinds[path_key(path[:i])]
        if kind == "rec":
            out.append((_REC, int(step)))
        elif kind == "arr":
            out.append((_ARR, int(step)))
        else:
            out.append((_DICT, key(step)))
    return tuple(out)


def _walk(v: Any, steps: tuple[tuple[int, Any], ...]) -> Any:
    """The value at ``steps`` under ``v`` (whose compound positions on the way have the
    kinds the steps say), or ``_MISSING``."""
    for kind, s in steps:
        if kind == _REC:
            f = v.fields
            if s >= len(f):
                return _MISSING
            v = f[s]
        elif kind == _ARR:
            if s >= len(v):
                return _MISSING
            v = _tuple_getitem(v, s)
        else:
            e = v._items.get(s)
            if e is None:
                return _MISSING
            v = e[1]
    return v


def _fields_only(kinds: dict[Path, str], paths: tuple[Path, ...]) -> list[int] | None:
    """The field indices, when every path is one field of the outermost record."""
    if kinds.get((), "") != "rec":
        return None
    out = []
    for p in paths:
        if len(p) != 1 or type(p[0]) is not int:
            return None
        out.append(p[0])
    return out


def _sk(x: Value) -> Any:
    """The key the index uses for a constant or capture: the value itself when its Python
    equality is already strict, else its strict key."""
    return x if type(x) in _PLAIN else key(x)


def _no_constants(v: Value) -> Any:
    return ()


def _compile_constants(
    kinds: dict[Path, str], const_paths: tuple[Path, ...], check_paths: tuple[Path, ...]
) -> Callable[[Value], Any]:
    """v -> strict key of the constant values (``()`` when none), or None if undefined."""
    fields = _fields_only(kinds, const_paths + check_paths)
    if fields is not None:
        need = max(fields, default=-1)  # the record must have this field
        idx = fields[: len(const_paths)]
        if not idx:
            if need < 0:
                return _no_constants

            def has_field(v: Any, need: int = need) -> Any:
                return () if need < len(v.fields) else None

            return has_field
        if len(idx) == 1:
            i0 = idx[0]

            def one_field(v: Any, i0: int = i0, need: int = need) -> Any:
                f = v.fields
                if need >= len(f):
                    return None
                c = f[i0]
                return c if type(c) in _PLAIN else key(c)

            return one_field
        if len(idx) == 2:
            i0, i1 = idx

            def two_fields(v: Any, i0: int = i0, i1: int = i1, need: int = need) -> Any:
                f = v.fields
                if need >= len(f):
                    return None
                c0 = f[i0]
                c1 = f[i1]
                return (c0 if type(c0) in _PLAIN else key(c0),
                        c1 if type(c1) in _PLAIN else key(c1))

            return two_fields
        tidx = tuple(idx)

        def some_fields(v: Any, idx: tuple[int, ...] = tidx, need: int = need) -> Any:
            f = v.fields
            if need >= len(f):
                return None
            return tuple([_sk(f[i]) for i in idx])

        return some_fields
    consts = tuple(_steps(kinds, p) for p in const_paths)
    checks = tuple(_steps(kinds, p) for p in check_paths)
    single = len(consts) == 1

    def walk_paths(v: Any, consts: tuple[Any, ...] = consts, checks: tuple[Any, ...] = checks,
                   single: bool = single) -> Any:
        for c in checks:
            if _walk(v, c) is _MISSING:
                return None
        out = []
        for c in consts:
            x = _walk(v, c)
            if x is _MISSING:
                return None
            out.append(x if type(x) in _PLAIN else key(x))
        if single:
            return out[0]
        return tuple(out)

    return walk_paths


def _no_captures(v: Value) -> Any:
    return ((), ())


def _compile_captures(kinds: dict[Path, str], capture_paths: tuple[Path, ...]) -> Callable[[Value], Any]:
    """v -> (strict key of the captures, captures tuple), or None if undefined."""
    if not capture_paths:
        return _no_captures
    fields = _fields_only(kinds, capture_paths)
    if fields is not None:
        need = max(fields)
        if len(fields) == 1:
            i0 = fields[0]

            def one_capture(v: Any, i0: int = i0) -> Any:
                f = v.fields
                if i0 >= len(f):
                    return None
                c = f[i0]
                return (c if type(c) in _PLAIN else key(c), (c,))

            return one_capture
        tidx = tuple(fields)

        def field_captures(v: Any, idx: tuple[int, ...] = tidx, need: int = need) -> Any:
            f = v.fields
            if need >= len(f):
                return None
            t = tuple([f[i] for i in idx])
            if _PLAIN.issuperset(map(type, t)):
                return (t, t)
            return (tuple(map(key, t)), t)

        return field_captures
    paths = tuple(_steps(kinds, p) for p in capture_paths)

    def walk_captures(v: Any, paths: tuple[Any, ...] = paths) -> Any:
        out = []
        for c in paths:
            x = _walk(v, c)
            if x is _MISSING:
                return None
            out.append(x)
        t = tuple(out)
        if _PLAIN.issuperset(map(type, t)):
            return (t, t)
        return (tuple(map(key, t)), t)

    return walk_captures


def _compile_step(kind: str, step: Any) -> Callable[[Any], Any]:
    """parent value -> child value at ``step``, or None when absent."""
    if step is None:
        return _identity
    if kind == "rec":
        i = int(step)

        def get_rec(r: Any) -> Any:
            f = r.fields
            return f[i] if i < len(f) else None

        return get_rec
    if kind == "arr":
        i = int(step)

        def get_arr(s: Any) -> Any:
            return _tuple_getitem(s, i) if i < len(s) else None

        return get_arr
    k = key(step)

    def get_dict(d: Any) -> Any:
        e = d._items.get(k)
        return None if e is None else e[1]

    return get_dict


def _class(v: Value) -> Any:
    """The key of ``v``'s class in the index's class tables: the name of a record's
    symbol label (a str: hashed in C, its hash kept by the string; a Symbol's __hash__ is
    Python code run at every lookup), a 1-tuple of the strict key of any other label,
    or the sequence / dictionary sentinel; None for an atom."""
    t = type(v)
    if t is Record:
        lab = v.label
        return lab.name if type(lab) is Symbol else (key(lab),)
    if t is Sequence:
        return SEQUENCE_CLASS
    if t is Dictionary:
        return DICTIONARY_CLASS
    return None


def _table_class(cls: Any) -> Any:
    """A skeleton's class (see :func:`dataspace.pattern.classof`) as :func:`_class`
    keys it."""
    if type(cls) is Symbol:
        return cls.name
    if cls is SEQUENCE_CLASS or cls is DICTIONARY_CLASS:
        return cls
    return (cls,)


def _identity(v: Any) -> Any:
    return v


# Generic (slow) projection, used only when a new node or group must be filled from a cache.


def _project(v: Value, path: Path) -> Any:
    for step in path:
        t = type(v)
        if t is Record:
            f = v.fields
            if type(step) is not int or not 0 <= step < len(f):
                return None
            v = f[step]
        elif t is Sequence:
            if type(step) is not int or not 0 <= step < len(v):
                return None
            v = _tuple_getitem(v, step)
        elif t is Dictionary:
            e = v._items.get(key(step))
            if e is None:
                return None
            v = e[1]
        else:
            return None
    return v


class Index:
    """The skeleton index: handlers by pattern, assertions as a bag, messages.

    >>> from dataspace.pattern import parse_pattern
    >>> from dataspace.values import parse
    >>> ix = Index(); events = []
    >>> ix.add_handler(parse_pattern('<Present $who>'), lambda e, c: events.append((e, c)))
    >>> ix.add_assertion(parse('<Present "alice">'))
    >>> ix.remove_assertion(parse('<Present "alice">'))
    >>> events
    [('+', ('alice',)), ('-', ('alice',))]
    """

    def __init__(self, sink: list[Any] | None = None) -> None:
        """With ``sink``, callbacks are not called: ``(event, callbacks, captures)``
        triples are appended to ``sink`` for the owner to dispatch."""
        self.sink = sink
        # strict key of each present assertion -> its id.  Every cache below is keyed by
        # the id (an int, hashed in C), so an assertion is hashed once per operation.
        # Copy counts above one live in ``extra`` (id -> count - 1).
        self.bag: dict[Any, int] = {}
        self.extra: dict[int, int] = {}
        self.values: dict[int, Value] = {}  # id -> assertion
        self.root = _Node(None, None, None, {})
        self.listener: Callable[[int, Pattern, Any], Any] | None = None
        """Called as ``listener(+1, pattern, callback)`` / ``listener(-1, pattern,
        callback)`` whenever a callback that hears messages is added for / removed from
        ``pattern`` (a message router's cache depends on them)."""
        self._busy = False
        self._next_id = 0

    # -- handlers ------------------------------------------------------------------------

    def _extend(self, skel: Skeleton) -> _Node:
        node = self.root
        h: Path = ()
        kinds = node.kinds
        for (up, down), cls in skel.visit:
            step = down[0] if down else None
            mkey = (up, None if step is None else (step if type(step) is int else key(step)))
            entry = node.moves.get(mkey)
            if entry is None:
                parent_path = h[: len(h) - up]
                kind = kinds.get(path_key(parent_path), "") if step is not None else ""
                entry = (_compile_step(kind, step), up, {})
                node.moves[mkey] = entry
                node.rebuild_move_list()
            table = entry[2]
            h = apply_move(h, (up, down))
            tk = _table_class(cls)
            nxt = table.get(tk)
            if nxt is None:
                new_kinds = dict(kinds)
                new_kinds[path_key(h)] = (
                    "arr" if cls is SEQUENCE_CLASS else "dict" if cls is DICTIONARY_CLASS else "rec"
                )
                nxt = _Node(node, mkey, tk, new_kinds)
                cache = nxt.cont.cache
                values = self.values
                for k in node.cont.cache:
                    if _class(_project(values[k], h)) == tk:
                        cache[k] = None
                table[tk] = nxt
            node = nxt
            kinds = node.kinds
        return node

    def add_handler(self, pattern: Pattern, callback: Callback, messages: bool = True) -> None:
        """Install ``callback`` for ``pattern``; it hears ``"+"`` at once for every
        distinct capture tuple of the assertions already present.  With ``messages``
        False it hears assertions only (a message never reaches it: it costs messages
        nothing)."""
        self._enter()
        try:
            skel = skeleton(pattern)
            node = self._extend(skel)
            cont = node.cont
            const_paths = tuple(p for p, _v in skel.constants)
            check_paths = tuple(skel.index_checks)
            ckey = (tuple(map(path_key, const_paths)), tuple(map(path_key, check_paths)))
            grp = cont.table.get(ckey)
            if grp is None:
                grp = _ConstGroup(_compile_constants(node.kinds, const_paths, check_paths))
                cont.table[ckey] = grp
                proj = grp.project
                leaves = grp.leaves
                values = self.values
                for k in cont.cache:
                    ck = proj(values[k])
                    if ck is not None:
                        leaf = leaves.get(ck)
                        if leaf is None:
                            leaf = leaves[ck] = _Leaf()
                        if leaf.one is None:
                            leaf.one = k
                        else:
                            leaf.cache[k] = None
            vals = [v for _p, v in skel.constants]
            cvals: Any = _sk(vals[0]) if len(vals) == 1 else tuple(map(_sk, vals))
            leaf = grp.leaves.get(cvals)
            if leaf is None:
                leaf = grp.leaves[cvals] = _Leaf()
            capkey = tuple(map(path_key, skel.captures))
            handler = leaf.handlers.get(capkey)
            if handler is None:
                entry = node.compiled.get(capkey)
                if entry is None:
                    entry = node.compiled[capkey] = [
                        _compile_captures(node.kinds, tuple(skel.captures)), 0]
                entry[1] += 1
                handler = _Handler(entry[0], pattern)
                leaf.handlers[capkey] = handler
                grp.nhandlers += 1
                proj = handler.project
                ids = list(leaf.cache)
                if leaf.one is not None:
                    ids.append(leaf.one)
                for k in ids:
                    r = proj(self.values[k])
                    if r is not None:
                        _bag_add(handler, r[0], r[1])
            if callback in handler.callbacks:
                return
            handler.callbacks[callback] = messages
            handler.set_callbacks()
            leaf.refresh(grp, cvals)
            cont.refresh_msg()
            initial = list(handler.bag.values())
            if handler.k1 is not _NO:
                initial.append(handler.c1)
            if messages and self.listener is not None:
                self.listener(1, pattern, callback)
        finally:
            self._busy = False
        if self.sink is not None:
            self.sink.extend(("+", (callback,), caps) for caps in initial)
        else:
            for caps in initial:
                callback("+", caps)

    def remove_handler(self, pattern: Pattern, callback: Callback) -> None:
        """Remove a handler added with an equal pattern and the same callback."""
        self._enter()
        try:
            skel = skeleton(pattern)
            node = self._find(skel)
            if node is None:
                return
            cont = node.cont
            ckey = (
                tuple(path_key(p) for p, _v in skel.constants),
                tuple(map(path_key, skel.index_checks)),
            )
            grp = cont.table.get(ckey)
            if grp is None:
                return
            vals = [v for _p, v in skel.constants]
            cvals = _sk(vals[0]) if len(vals) == 1 else tuple(map(_sk, vals))
            leaf = grp.leaves.get(cvals)
            if leaf is None:
                return
            capkey = tuple(map(path_key, skel.captures))
            handler = leaf.handlers.get(capkey)
            if handler is None or callback not in handler.callbacks:
                return
            if handler.callbacks[callback] and self.listener is not None:
                self.listener(-1, pattern, callback)
            del handler.callbacks[callback]
            handler.set_callbacks()
            if handler.callbacks:
                leaf.refresh(grp, cvals)
                cont.refresh_msg()
                return
            del leaf.handlers[capkey]
            entry = node.compiled[capkey]
            entry[1] -= 1
            if not entry[1]:
                del node.compiled[capkey]
            leaf.refresh(grp, cvals)
            grp.nhandlers -= 1
            if leaf.one is None and not leaf.cache and not leaf.handlers:
                del grp.leaves[cvals]
            if grp.nhandlers == 0:
                # No handler needs these constants any more: drop the group and its leaves.
                del cont.table[ckey]
            cont.refresh_msg()
            self._prune(node)
        finally:
            self._busy = False

    def _find(self, skel: Skeleton) -> _Node | None:
        node = self.root
        for (up, down), cls in skel.visit:
            step = down[0] if down else None
            mkey = (up, None if step is None else (step if type(step) is int else key(step)))
            entry = node.moves.get(mkey)
            if entry is None:
                return None
            nxt = entry[2].get(_table_class(cls))
            if nxt is None:
                return None
            node = nxt
        return node

    def _prune(self, node: _Node) -> None:
        while node.parent is not None and not node.cont.table and not node.moves:
            parent = node.parent
            entry = parent.moves[node.move_key]
            del entry[2][node.cls]
            if not entry[2]:
                del parent.moves[node.move_key]
                parent.rebuild_move_list()
            node = parent

    # -- assertions and messages -------------------------------------------------------

    def add_assertion(self, value: Value) -> None:
        """Add one copy of ``value``; handlers hear ``"+"`` if it was absent."""
        self.adjust_assertion(value, 1)

    def remove_assertion(self, value: Value) -> None:
        """Remove one copy of ``value`` (no effect if absent); handlers hear ``"-"`` when
        the last copy goes."""
        self.adjust_assertion(value, -1)

    def adjust_assertion(self, value: Value, delta: int) -> bool:
        """Change the copy count of ``value`` by ``delta``.  Returns True when the value
        appeared or disappeared (the observable contents changed)."""
        if type(value) in _PLAIN_NOINT:
            k = value
        else:
            value = strip(preserve(value))
            k = key(value)  # an int: big ones salted (their raw hashes can be made to collide)
        bag = self.bag
        if delta > 0:
            vid = self._next_id + 1
            old = bag.setdefault(k, vid)  # one hash for lookup and insertion
            if old != vid:
                self.extra[old] = self.extra.get(old, 0) + delta
                return False
            if delta > 1:
                self.extra[vid] = delta - 1
            if self._busy:
                del bag[k]
                self._enter()
            self._next_id = vid
            sink = self.sink
            fire: list[Any] = [] if sink is None else sink
            self._busy = True
            try:
                root = self.root
                self.values[vid] = value
                root.cont.cache[vid] = None
                if root.cont.table:
                    _add_visit(_EMPTY_NODE, [value], vid, value, fire, root.cont)
                if root.move_list:
                    if type(value) is Record:  # _class(), inlined: the hottest line
                        cls = value.label
                        cls = cls.name if type(cls) is Symbol else (key(cls),)
                    else:
                        cls = _class(value)
                    nxt = root.move_list[0][2].get(cls)
                    if nxt is not None:
                        _add_visit(nxt, [value, value], vid, value, fire, nxt.cont)
            finally:
                self._busy = False
            if sink is None:
                _fire(fire)
            return True
        if delta == 0:
            return False
        vid = bag.get(k)
        if vid is None:
            return False
        extra = self.extra
        if extra:
            more = extra.get(vid)
            if more is not None:
                more += delta
                if more > 0:
                    extra[vid] = more
                    return False
                del extra[vid]
                if more == 0:
                    return False
        if self._busy:
            self._enter()
        del bag[k]
        sink = self.sink
        fire = [] if sink is None else sink
        self._busy = True
        try:
            _del_root(self.root, vid, self.values.pop(vid), fire)
        finally:
            self._busy = False
        if sink is None:
            _fire(fire)
        return True

    def send_message(self, value: Value) -> None:
        """Deliver ``value`` as a message: every matching handler hears ``"!"``."""
        if type(value) not in _PLAIN:
            value = strip(preserve(value))
        if self._busy:
            self._enter()
        sink = self.sink
        fire: list[Any] = [] if sink is None else sink
        self._busy = True
        try:
            root = self.root
            if root.cont.has_msg:  # (a server's links observe everything, assertions only)
                _msg_visit(_EMPTY_NODE, [value], value, fire, root.cont)
            if root.move_list:
                if type(value) is Record:  # _class(), inlined
                    cls = value.label
                    cls = cls.name if type(cls) is Symbol else (key(cls),)
                else:
                    cls = _class(value)
                nxt = root.move_list[0][2].get(cls)
                if nxt is not None:
                    _msg_visit(nxt, [value, value], value, fire, nxt.cont)
        finally:
            self._busy = False
        if sink is None:
            _fire(fire)

    def message_matches(self, value: Value) -> list[tuple[_Handler, tuple[Callback, ...]]]:
        """The handlers a message ``value`` reaches, in the order :meth:`send_message`
        fires them, each with its callbacks that hear messages (what a message router
        caches).  Does not fire anything."""
        if type(value) not in _PLAIN:
            value = strip(preserve(value))
        out: list[tuple[_Handler, tuple[Callback, ...]]] = []
        root = self.root
        if root.cont.has_msg:
            _match_visit(_EMPTY_NODE, [value], value, out, root.cont)
        if root.move_list:
            nxt = root.move_list[0][2].get(_class(value))
            if nxt is not None:
                _match_visit(nxt, [value, value], value, out, nxt.cont)
        return out

    def message_patterns(self) -> list[tuple[Pattern, int]]:
        """Every handler's pattern with how many of its callbacks hear messages (those
        with some)."""
        out = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            for grp in n.cont.table.values():
                for leaf in grp.leaves.values():
                    for h in leaf.hlist:
                        if h.mcbs:
                            out.append((h.pattern, len(h.mcbs)))
            for _get, _up, table in n.moves.values():
                stack.extend(table.values())
        return out

    def _enter(self) -> None:
        if self._busy:
            raise RuntimeError(
                "the index was modified from inside one of its callbacks; queue the change "
                "and apply it after the callback returns (Dataspace does this for you)"
            )
        self._busy = True

    # -- introspection -----------------------------------------------------------------

    def _bag_key(self, value: Value) -> Any:
        """The bag's key for ``value`` (as :meth:`add_assertion` computes it)."""
        return value if type(value) in _PLAIN_NOINT else key(strip(preserve(value)))

    def __contains__(self, value: Value) -> bool:
        return self._bag_key(value) in self.bag

    def count(self, value: Value) -> int:
        """How many copies of ``value`` are asserted."""
        vid = self.bag.get(self._bag_key(value))
        return 0 if vid is None else 1 + self.extra.get(vid, 0)

    def assertions(self) -> list[Value]:
        """The distinct assertions present."""
        return list(self.values.values())

    def compact(self) -> None:
        """Give back the memory of tables that were once large (a Python dict never
        shrinks by itself when entries are deleted); O(size), for after a big release."""
        self.bag = dict(self.bag)
        self.extra = dict(self.extra)
        self.values = dict(self.values)
        stack = [self.root]
        while stack:
            n = stack.pop()
            n.cont.cache = dict(n.cont.cache)
            for grp in n.cont.table.values():
                grp.leaves = dict(grp.leaves)
                for leaf in grp.leaves.values():
                    leaf.cache = dict(leaf.cache)
                    for h in leaf.handlers.values():
                        h.bag = dict(h.bag)
                        h.extra = dict(h.extra)
            for _get, _up, table in n.moves.values():
                stack.extend(table.values())

    def stats(self) -> dict[str, int]:
        """Sizes of every part of the index (for memory tests and diagnostics)."""
        s = {"assertions": len(self.bag), "nodes": 0, "shapes": 0, "groups": 0, "leaves": 0,
             "handlers": 0, "callbacks": 0, "cached": 0, "compiled": 0}

        def walk(n: _Node) -> None:
            s["nodes"] += 1
            if n.cont.table:
                s["shapes"] += 1  # a node where some pattern's shape ends
            s["compiled"] += len(n.compiled)
            s["cached"] += len(n.cont.cache)
            for grp in n.cont.table.values():
                s["groups"] += 1
                for leaf in grp.leaves.values():
                    s["leaves"] += 1
                    s["cached"] += len(leaf.cache) + (leaf.one is not None)
                    for h in leaf.handlers.values():
                        s["handlers"] += 1
                        s["callbacks"] += len(h.callbacks)
                        s["cached"] += len(h.bag) + (h.k1 is not _NO)
            for _get, _up, table in n.moves.values():
                for child in table.values():
                    walk(child)

        walk(self.root)
        return s


def _bag_add(handler: _Handler, rk: Any, caps: tuple[Any, ...]) -> bool:
    """Add one copy of ``caps`` to the handler's bag; True if it was not there."""
    k1 = handler.k1
    if k1 is _NO and not handler.bag:
        handler.k1 = rk
        handler.c1 = caps
        return True
    if k1 is not _NO and k1 == rk:
        new = False
    else:
        bag = handler.bag
        n = len(bag)
        bag.setdefault(rk, caps)
        new = len(bag) != n
    if not new:
        handler.extra[rk] = handler.extra.get(rk, 0) + 1
    return new


def _fire(fire: list[Any]) -> None:
    for event, callbacks, caps in fire:
        for cb in callbacks:
            cb(event, caps)


def _children(node: _Node, stack: list[Any]) -> Iterator[tuple[_Node, list[Any]]]:
    """The child nodes a value reaches through ``node``'s moves, with their stacks."""
    for up, get, table in node.move_list:
        base = stack if up == 0 else stack[: len(stack) - up]
        child = get(base[-1])
        if child is not None:
            nxt = table.get(_class(child))
            if nxt is not None:
                yield nxt, [*base, child]


_EMPTY_NODE = _Node(None, None, None, {})  # stands for "no moves" at the root

# At the root the only move is (0, []): the class of the whole value picks the child.


def _del_root(root: _Node, vid: int, v: Value, fire: list[Any]) -> None:
    root.cont.cache.pop(vid, None)
    if root.cont.table:
        _del_visit(_EMPTY_NODE, [v], vid, v, fire, root.cont)
    if root.move_list:
        if type(v) is Record:  # _class(), inlined
            cls = v.label
            cls = cls.name if type(cls) is Symbol else (key(cls),)
        else:
            cls = _class(v)
        nxt = root.move_list[0][2].get(cls)
        if nxt is not None:
            _del_visit(nxt, [v, v], vid, v, fire, nxt.cont)


# The three traversals (seed 000's ``modify`` specialised per operation).  ``stack`` holds
# the values along the current path, the last one being the value at the node's position.
# Callbacks are collected in ``fire`` and invoked after the index is consistent again.


def _add_visit(
    node: _Node, stack: list[Any], k: int, v: Value, fire: list[Any], cont: _Continuation
) -> None:
    cont.cache[k] = None
    for grp in cont.table.values():
        ck = grp.project(v)
        if ck is None:
            continue
        leaf = grp.leaves.get(ck)
        if leaf is None:
            leaf = grp.leaves[ck] = _Leaf()
        if leaf.one is None:
            leaf.one = k
        else:
            leaf.cache[k] = None
        for handler in leaf.hlist:
            r = handler.project(v)
            if r is None:
                continue
            rk, caps = r
            k1 = handler.k1
            if k1 is _NO and not handler.bag:
                handler.k1 = rk
                handler.c1 = caps
                new = True
            elif k1 is not _NO and k1 == rk:
                new = False
            else:
                bag = handler.bag
                n = len(bag)
                bag.setdefault(rk, caps)
                new = len(bag) != n
            if new:
                cbs = handler.cbs
                if cbs:
                    fire.append(("+", cbs, caps))
            else:
                extra = handler.extra
                extra[rk] = extra.get(rk, 0) + 1
    if node.move_list:
        for nxt, st in _children(node, stack):
            _add_visit(nxt, st, k, v, fire, nxt.cont)


def _del_visit(
    node: _Node, stack: list[Any], k: int, v: Value, fire: list[Any], cont: _Continuation
) -> None:
    cont.cache.pop(k, None)
    for grp in cont.table.values():
        ck = grp.project(v)
        if ck is None:
            continue
        leaves = grp.leaves
        leaf = leaves.get(ck)
        if leaf is None:
            continue
        if leaf.one == k:
            leaf.one = None
        else:
            leaf.cache.pop(k, None)
        for handler in leaf.hlist:
            r = handler.project(v)
            if r is None:
                continue
            rk = r[0]
            extra = handler.extra
            if extra:
                more = extra.get(rk)
                if more is not None:
                    if more == 1:
                        del extra[rk]
                    else:
                        extra[rk] = more - 1
                    continue
            k1 = handler.k1
            if k1 is not _NO and k1 == rk:
                caps = handler.c1
                handler.k1 = _NO
                handler.c1 = None
            else:
                caps = handler.bag.pop(rk, None)
            if caps is not None:
                cbs = handler.cbs
                if cbs:
                    fire.append(("-", cbs, caps))
        if leaf.one is None and not leaf.cache and not leaf.handlers:
            del leaves[ck]
    if node.move_list:
        for nxt, st in _children(node, stack):
            _del_visit(nxt, st, k, v, fire, nxt.cont)


def _msg_visit(
    node: _Node, stack: list[Any], v: Value, fire: list[Any], cont: _Continuation
) -> None:
    for grp in cont.table.values():
        msg = grp.msg
        if not msg:
            continue  # assertion-only handlers
        ck = grp.project(v)
        if ck is None:
            continue
        m = msg.get(ck)
        if m is None:
            continue
        r = m[0](v)
        if r is not None:
            fire.append(("!", m[1], r[1]))
        for i in range(2, len(m), 2):
            r = m[i](v)
            if r is not None:
                fire.append(("!", m[i + 1], r[1]))
    if node.move_list:
        for nxt, st in _children(node, stack):
            _msg_visit(nxt, st, v, fire, nxt.cont)


def _match_visit(
    node: _Node, stack: list[Any], v: Value, out: list[Any], cont: _Continuation
) -> None:
    """:func:`_msg_visit` collecting the handlers reached instead of firing them."""
    for grp in cont.table.values():
        if not grp.msg:
            continue
        ck = grp.project(v)
        if ck is None or ck not in grp.msg:
            continue
        leaf = grp.leaves.get(ck)
        if leaf is None:  # pragma: no cover - a message entry has its leaf
            continue
        for h in leaf.hlist:
            if h.mcbs and h.project(v) is not None:
                out.append((h, h.mcbs))
    if node.move_list:
        for nxt, st in _children(node, stack):
            _match_visit(nxt, st, v, out, nxt.cont)
