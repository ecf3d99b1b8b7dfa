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

from collections.abc import Callable
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


# ---------------------------------------------------------------------------------------
# Projections: the values at a continuation's constant and check paths, and at a
# handler's capture paths.  Made once per constant group / capture map as small objects
# over the paths (no generated code): paths into the fields of the outermost record --
# most patterns' -- get dedicated classes, any other path a walk over its steps.  (Compiled,
# each is a native class and ``get`` a direct call through its method table.)


class _Project:
    """v -> strict key of the constant values (``()`` when none), or None if undefined."""

    def get(self, v: Any) -> Any:
        return ()


class _HasField(_Project):
    def __init__(self, need: int) -> None:
        self.need = need

    def get(self, v: Any) -> Any:
        r: Record = v  # the outermost value is a record here (see _fields_only)
        return () if self.need < len(r.fields) else None


class _OneField(_Project):
    def __init__(self, i0: int, need: int) -> None:
        self.i0 = i0
        self.need = need

    def get(self, v: Any) -> Any:
        r: Record = v
        f: tuple[Any, ...] = r.fields
        if self.need >= len(f):
            return None
        c = f[self.i0]
        t = type(c)
        if t is str or t is Symbol or t in _PLAIN:
            return c
        return key(c)


class _TwoFields(_Project):
    def __init__(self, i0: int, i1: int, need: int) -> None:
        self.i0 = i0
        self.i1 = i1
        self.need = need

    def get(self, v: Any) -> Any:
        r: Record = v
        f: tuple[Any, ...] = r.fields
        if self.need >= len(f):
            return None
        return (_sk(f[self.i0]), _sk(f[self.i1]))


class _SomeFields(_Project):
    def __init__(self, idx: tuple[int, ...], need: int) -> None:
        self.idx = idx
        self.need = need

    def get(self, v: Any) -> Any:
        r: Record = v
        f: tuple[Any, ...] = r.fields
        if self.need >= len(f):
            return None
        return tuple([_sk(f[i]) for i in self.idx])


class _WalkPaths(_Project):
    def __init__(self, consts: tuple[Any, ...], checks: tuple[Any, ...]) -> None:
        self.consts = consts
        self.checks = checks
        self.single = len(consts) == 1

    def get(self, v: Any) -> Any:
        for c in self.checks:
            if _walk(v, c) is _MISSING:
                return None
        out = []
        for c in self.consts:
            x = _walk(v, c)
            if x is _MISSING:
                return None
            out.append(_sk(x))
        if self.single:
            return out[0]
        return tuple(out)


class _Captures:
    """v -> the captures (a tuple), or None if undefined."""

    def get(self, v: Any) -> tuple[Any, ...] | None:
        return ()


class _OneCapture(_Captures):
    def __init__(self, i0: int) -> None:
        self.i0 = i0

    def get(self, v: Any) -> tuple[Any, ...] | None:
        r: Record = v
        f: tuple[Any, ...] = r.fields
        i0 = self.i0
        if i0 >= len(f):
            return None
        return (f[i0],)


class _FieldCaptures(_Captures):
    def __init__(self, idx: tuple[int, ...], need: int) -> None:
        self.idx = idx
        self.need = need

    def get(self, v: Any) -> tuple[Any, ...] | None:
        r: Record = v
        f: tuple[Any, ...] = r.fields
        if self.need >= len(f):
            return None
        return tuple([f[i] for i in self.idx])


class _WalkCaptures(_Captures):
    def __init__(self, paths: tuple[Any, ...]) -> None:
        self.paths = paths

    def get(self, v: Any) -> tuple[Any, ...] | None:
        out = []
        for c in self.paths:
            x = _walk(v, c)
            if x is _MISSING:
                return None
            out.append(x)
        return tuple(out)


class _Step:
    """Parent value -> child value at one step of a move, or None when absent (the
    identity: the root's move to the whole value)."""

    def get(self, v: Any) -> Any:
        return v


class _RecStep(_Step):
    def __init__(self, i: int) -> None:
        self.i = i

    def get(self, v: Any) -> Any:
        f: tuple[Any, ...] = v.fields
        i = self.i
        return f[i] if i < len(f) else None


class _ArrStep(_Step):
    def __init__(self, i: int) -> None:
        self.i = i

    def get(self, v: Any) -> Any:
        i = self.i
        return _tuple_getitem(v, i) if i < len(v) else None


class _DictStep(_Step):
    def __init__(self, k: Any) -> None:
        self.k = k

    def get(self, v: Any) -> Any:
        e = v._items.get(self.k)
        return None if e is None else e[1]


class _Move:
    """One move out of a node: how far up, the step down, and the child nodes by the
    class of what is there."""

    __slots__ = ("step", "table", "up")

    def __init__(self, up: int, step: _Step) -> None:
        self.up = up
        self.step = step
        self.table: dict[Any, _Node] = {}


class _CapEntry:
    """A capture projection shared by the handlers of one node with these capture paths."""

    __slots__ = ("project", "users")

    def __init__(self, project: _Captures) -> None:
        self.project = project
        self.users = 0


class _Node:
    __slots__ = ("cls", "compiled", "cont", "kinds", "move_key", "move_list", "moves", "parent")

    def __init__(
        self, parent: _Node | None, move_key: Any, cls: Any, kinds: dict[Any, str]
    ) -> None:
        self.cont = _Continuation()
        # move key -> move; move_list mirrors its values, for fast iteration.
        self.moves: dict[Any, _Move] = {}
        self.move_list: list[_Move] = []
        self.parent = parent
        self.move_key = move_key
        self.cls = cls
        self.kinds = kinds
        # capture paths -> the projection and how many handlers use it (shared by every
        # leaf under this node; dropped with its last handler)
        self.compiled: dict[Any, _CapEntry] = {}

    def rebuild_move_list(self) -> None:
        self.move_list = list(self.moves.values())


class _Continuation:
    __slots__ = ("cache", "groups", "has_msg", "table")

    def __init__(self) -> None:
        self.cache: dict[int, None] = {}  # ids of the assertions that reach here
        self.table: dict[Any, _ConstGroup] = {}
        self.groups: list[_ConstGroup] = []  # table.values(), for fast iteration
        self.has_msg = False  # some handler here hears messages

    def refresh(self) -> None:
        self.groups = list(self.table.values())
        self.has_msg = any(grp.msg for grp in self.groups)


class _ConstGroup:
    """``table[(constant paths, check paths)]``: leaves by constant values."""

    __slots__ = ("leaves", "msg", "nhandlers", "project")

    def __init__(self, project: _Project) -> None:
        self.project = project
        self.leaves: dict[Any, _Leaf] = {}
        # What a message needs and nothing else: constant values -> the handlers of that
        # leaf with callbacks hearing messages, so a message touches one dict per group.
        self.msg: dict[Any, tuple[_Handler, ...]] = {}
        self.nhandlers = 0


def _leaf_ids(leaf: _Leaf) -> list[int]:
    """The ids of the assertions at ``leaf``, about in the order they came (``one`` is
    the first, unless it went and came back while others stayed)."""
    if leaf.one < 0:
        return list(leaf.cache)
    ids = [leaf.one]
    ids += leaf.cache
    return ids


def _exact_arity(kinds: dict[Any, str], paths: tuple[Path, ...]) -> int:
    """The arity of the records whose fields are all at ``paths`` (constants and
    captures: the captures then determine the value, see :class:`_Handler`), or -1."""
    idx = _fields_only(kinds, paths)
    if idx is None:
        return -1
    fields = set(idx)
    return len(fields) if fields == set(range(len(fields))) else -1


class _Leaf:
    __slots__ = ("cache", "handlers", "hlist", "one")

    def __init__(self) -> None:
        # Ids of the assertions with these constants: the first in ``one`` (-1: none),
        # any more in ``cache`` (most leaves hold one assertion, and a dict costs an
        # allocation).
        self.one = -1
        self.cache: dict[int, None] = {}
        self.handlers: dict[Any, _Handler] = {}
        self.hlist: tuple[_Handler, ...] = ()  # handlers.values(), for fast iteration

    def refresh(self, grp: _ConstGroup, ck: Any) -> None:
        """Recompute the derived tuples after a handler or callback change."""
        self.hlist = tuple(self.handlers.values())
        hearing = tuple([h for h in self.hlist if h.mcbs])
        if hearing:
            grp.msg[ck] = hearing
        elif ck in grp.msg:
            del grp.msg[ck]

    def empty(self) -> bool:
        return self.one < 0 and not self.cache and not self.handlers


class _NoEntry:
    """The type of "no entry" in a handler's first-entry slot."""

    __slots__ = ()


_NO = _NoEntry()


class _Handler:
    __slots__ = ("arity", "bag", "c1", "callbacks", "cbs", "exact", "extra", "k1", "mcbs",
                 "pattern", "project")

    def __init__(self, project: _Captures, pattern: Pattern, arity: int = -1) -> None:
        self.project = project
        self.pattern = pattern  # the first pattern of this handler (all have its captures)
        # Exact handlers keep no bag.  When the leaf's constants and the captures are every
        # field of a record of ``arity`` fields, the captures of a value with exactly that
        # many fields determine the value: distinct assertions are distinct capture
        # tuples, so "+" and "-" follow the assertion's own appearance and disappearance
        # and the bag would only repeat the leaf.  The first value reaching the handler
        # with more fields (the pattern matches those too) ends this for good:
        # :meth:`to_bag` fills the bag from the leaf and the handler counts from then on.
        self.arity = arity  # -1: the captures do not determine the value
        self.exact = arity >= 0
        # Bag of capture tuples, strict key -> captures: the first distinct entry in
        # ``k1``/``c1``, any more in ``bag`` (a dict costs an allocation, and many
        # handlers only ever hold one).  A count above one is kept in ``extra``
        # (key -> count - 1), so the common case allocates nothing.
        self.k1: Any = _NO
        self.c1: tuple[Any, ...] = ()
        self.bag: dict[Any, tuple[Any, ...]] = {}
        self.extra: dict[Any, int] = {}
        self.callbacks: dict[Any, bool] = {}  # callback -> hears messages
        self.cbs: tuple[Any, ...] = ()  # the callbacks, as a tuple for firing
        self.mcbs: tuple[Any, ...] = ()  # those that hear messages

    def set_callbacks(self) -> None:
        self.cbs = tuple(self.callbacks)
        self.mcbs = tuple([cb for cb, m in self.callbacks.items() if m])

    def add(self, rk: Any, caps: tuple[Any, ...]) -> bool:
        """Add one copy of ``caps`` (strict key ``rk``) to the bag; True if it was not
        there."""
        k1 = self.k1
        if k1 is _NO:
            if not self.bag:
                self.k1 = rk
                self.c1 = caps
                return True
        elif k1 == rk:
            extra = self.extra
            extra[rk] = extra.get(rk, 0) + 1
            return False
        bag = self.bag
        n = len(bag)
        bag.setdefault(rk, caps)  # one lookup for both
        if len(bag) != n:
            return True
        extra = self.extra
        extra[rk] = extra.get(rk, 0) + 1
        return False

    def remove(self, rk: Any) -> tuple[Any, ...] | None:
        """Remove one copy of the captures whose key is ``rk``; the captures when the
        last copy went, else None."""
        extra = self.extra
        if extra:
            more = extra.get(rk)
            if more is not None:
                if more == 1:
                    del extra[rk]
                else:
                    extra[rk] = more - 1
                return None
        k1 = self.k1
        if k1 is not _NO and k1 == rk:
            caps = self.c1
            self.k1 = _NO
            self.c1 = ()
            return caps
        bag = self.bag
        got = bag.get(rk)
        if got is not None:
            del bag[rk]
        return got

    def to_bag(self, leaf: _Leaf, slots: list[Any], skip: int) -> None:
        """Leave exact mode: count the captures of the leaf's assertions (but ``skip``,
        the one being added) in the bag."""
        self.exact = False
        project = self.project
        for k in _leaf_ids(leaf):
            if k != skip:
                caps = project.get(slots[k])
                if caps is not None:
                    self.add(_caps_key(caps), caps)

    def entries(self, leaf: _Leaf, slots: list[Any]) -> list[tuple[Any, ...]]:
        """The distinct capture tuples held (``leaf``: the handler's)."""
        if self.exact:
            project = self.project
            got = [project.get(slots[k]) for k in _leaf_ids(leaf)]
            return [caps for caps in got if caps is not None]
        out = [] if self.k1 is _NO else [self.c1]  # (the first held, as a rule)
        out += self.bag.values()
        return out


_REC = 0
_ARR = 1
_DICT = 2


class _Missing:
    __slots__ = ()


_MISSING = _Missing()


def _steps(kinds: dict[Any, str], path: Path) -> tuple[tuple[int, Any], ...]:
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


def _fields_only(kinds: dict[Any, str], paths: tuple[Path, ...]) -> list[int] | None:
    """The field indices, when every path is one field of the outermost record."""
    if kinds.get((), "") != "rec":
        return None
    out = []
    for p in paths:
        if len(p) != 1 or type(p[0]) is not int:
            return None
        out.append(p[0])
    return out


def _sk(x: Any) -> Any:
    """The key the index uses for a constant or capture: the value itself when its Python
    equality is already strict, else its strict key."""
    t = type(x)
    if t is str or t is Symbol or t in _PLAIN:
        return x
    return key(x)


def _caps_key(caps: tuple[Any, ...]) -> Any:
    """The strict key of a captures tuple: its one item's (:func:`_sk`), or the tuple
    itself when every item is compared strictly already."""
    if len(caps) == 1:
        return _sk(caps[0])
    for c in caps:
        if type(c) not in _PLAIN:
            return tuple([key(x) for x in caps])
    return caps


_NO_CONSTANTS = _Project()
_NO_CAPTURES = _Captures()


def _compile_constants(
    kinds: dict[Any, str], const_paths: tuple[Path, ...], check_paths: tuple[Path, ...]
) -> _Project:
    """The projection of a constant group (see :class:`_Project`)."""
    fields = _fields_only(kinds, const_paths + check_paths)
    if fields is not None:
        need = max(fields, default=-1)  # the record must have this field
        idx = fields[: len(const_paths)]
        if not idx:
            return _NO_CONSTANTS if need < 0 else _HasField(need)
        if len(idx) == 1:
            return _OneField(idx[0], need)
        if len(idx) == 2:
            return _TwoFields(idx[0], idx[1], need)
        return _SomeFields(tuple(idx), need)
    return _WalkPaths(
        tuple([_steps(kinds, p) for p in const_paths]),
        tuple([_steps(kinds, p) for p in check_paths]),
    )


def _compile_captures(kinds: dict[Any, str], capture_paths: tuple[Path, ...]) -> _Captures:
    """The projection of a handler's captures (see :class:`_Captures`)."""
    if not capture_paths:
        return _NO_CAPTURES
    fields = _fields_only(kinds, capture_paths)
    if fields is not None:
        if len(fields) == 1:
            return _OneCapture(fields[0])
        return _FieldCaptures(tuple(fields), max(fields))
    return _WalkCaptures(tuple([_steps(kinds, p) for p in capture_paths]))


def _compile_step(kind: str, step: Any) -> _Step:
    """parent value -> child value at ``step``, or None when absent."""
    if step is None:
        return _IDENTITY
    if kind == "rec":
        return _RecStep(int(step))
    if kind == "arr":
        return _ArrStep(int(step))
    return _DictStep(key(step))


_IDENTITY = _Step()


def _class(v: Any) -> Any:
    """The key of ``v``'s class in the index's class tables: the name of a record's
    symbol label (a str: hashed in C, its hash kept by the string), a 1-tuple of the
    strict key of any other label, or the sequence / dictionary sentinel; None for an
    atom."""
    t = type(v)
    if t is Record:
        r: Record = v
        lab = r.label
        if type(lab) is Symbol:
            sym: Symbol = lab
            return sym.name
        return (key(lab),)
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
        """With ``sink`` (a list), callbacks are not called: ``(event, callbacks,
        captures)`` triples are appended to it for the owner to dispatch."""
        self.sink = sink
        # strict key of each present assertion -> its id.  Every cache below is keyed by
        # the id (an int, hashed in C), so an assertion is hashed once per operation.
        # Copy counts above one live in ``extra`` (id -> count - 1).
        self.bag: dict[Any, int] = {}
        self.extra: dict[int, int] = {}
        # id -> assertion: ids are slots of this list, reused once free (None), so they
        # stay small and the table needs no hashing.
        self._slots: list[Any] = []
        self._free: list[int] = []
        self.root = _Node(None, None, None, {})
        self.listener: Callable[[int, Pattern, Any], Any] | None = None
        """Called as ``listener(+1, pattern, callback)`` / ``listener(-1, pattern,
        callback)`` whenever a callback that hears messages is added for / removed from
        ``pattern`` (a message router's cache depends on them)."""
        self._busy = False

    def _ids_at(self, node: _Node) -> list[int]:
        """The ids of the assertions that reach ``node`` (the root: all of them)."""
        if node is self.root:
            return list(self.bag.values())
        return list(node.cont.cache)

    # -- handlers ------------------------------------------------------------------------

    def _extend(self, skel: Skeleton) -> _Node:
        node = self.root
        h: Path = ()
        kinds = node.kinds
        slots = self._slots
        for (up, down), cls in skel.visit:
            step = down[0] if down else None
            mkey = (up, None if step is None else (step if type(step) is int else key(step)))
            mv = node.moves.get(mkey)
            if mv is None:
                parent_path = h[: len(h) - up]
                kind = kinds.get(path_key(parent_path), "") if step is not None else ""
                mv = _Move(up, _compile_step(kind, step))
                node.moves[mkey] = mv
                node.rebuild_move_list()
            table = mv.table
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
                for k in self._ids_at(node):
                    if _class(_project(slots[k], h)) == tk:
                        cache[k] = None
                table[tk] = nxt
            node = nxt
            kinds = node.kinds
        return node

    def add_handler(self, pattern: Pattern, callback: Any, messages: bool = True) -> None:
        """Install ``callback`` for ``pattern``; it hears ``"+"`` at once for every
        distinct capture tuple of the assertions already present.  With ``messages``
        False it hears assertions only (a message never reaches it: it costs messages
        nothing)."""
        self._enter()
        try:
            skel = skeleton(pattern)
            node = self._extend(skel)
            cont = node.cont
            slots = self._slots
            const_paths = tuple([p for p, _v in skel.constants])
            check_paths = tuple(skel.index_checks)
            ckey = (tuple(map(path_key, const_paths)), tuple(map(path_key, check_paths)))
            grp = cont.table.get(ckey)
            if grp is None:
                grp = _ConstGroup(_compile_constants(node.kinds, const_paths, check_paths))
                cont.table[ckey] = grp
                cont.refresh()
                proj = grp.project
                leaves = grp.leaves
                for k in self._ids_at(node):
                    ck = proj.get(slots[k])
                    if ck is not None:
                        leaf = leaves.get(ck)
                        if leaf is None:
                            leaf = leaves[ck] = _Leaf()
                        if leaf.one < 0:
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
                    entry = node.compiled[capkey] = _CapEntry(
                        _compile_captures(node.kinds, tuple(skel.captures)))
                entry.users += 1
                arity = _exact_arity(node.kinds, const_paths + tuple(skel.captures))
                handler = _Handler(entry.project, pattern, arity)
                leaf.handlers[capkey] = handler
                grp.nhandlers += 1
                if handler.exact:
                    for k in _leaf_ids(leaf):
                        r: Record = slots[k]
                        if len(r.fields) != arity and handler.project.get(r) is not None:
                            handler.to_bag(leaf, slots, -1)
                            break
                else:
                    cproj = handler.project
                    for k in _leaf_ids(leaf):
                        caps = cproj.get(slots[k])
                        if caps is not None:
                            handler.add(_caps_key(caps), caps)
            if callback in handler.callbacks:
                return
            handler.callbacks[callback] = messages
            handler.set_callbacks()
            leaf.refresh(grp, cvals)
            cont.refresh()
            initial = handler.entries(leaf, slots)
            if messages and self.listener is not None:
                self.listener(1, pattern, callback)
        finally:
            self._busy = False
        sink = self.sink
        if sink is not None:
            cbt = (callback,)
            for caps in initial:
                sink.append(("+", cbt, caps))
        else:
            for caps in initial:
                callback("+", caps)

    def remove_handler(self, pattern: Pattern, callback: Any) -> None:
        """Remove a handler added with an equal pattern and the same callback."""
        self._enter()
        try:
            skel = skeleton(pattern)
            node = self._find(skel)
            if node is None:
                return
            cont = node.cont
            ckey = (
                tuple([path_key(p) for p, _v in skel.constants]),
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
                cont.refresh()
                return
            del leaf.handlers[capkey]
            entry = node.compiled[capkey]
            entry.users -= 1
            if not entry.users:
                del node.compiled[capkey]
            leaf.refresh(grp, cvals)
            grp.nhandlers -= 1
            if leaf.empty():
                del grp.leaves[cvals]
            if grp.nhandlers == 0:
                # No handler needs these constants any more: drop the group and its leaves.
                del cont.table[ckey]
            cont.refresh()
            self._prune(node)
        finally:
            self._busy = False

    def _find(self, skel: Skeleton) -> _Node | None:
        node = self.root
        for (up, down), cls in skel.visit:
            step = down[0] if down else None
            mkey = (up, None if step is None else (step if type(step) is int else key(step)))
            mv = node.moves.get(mkey)
            if mv is None:
                return None
            nxt = mv.table.get(_table_class(cls))
            if nxt is None:
                return None
            node = nxt
        return node

    def _prune(self, node: _Node) -> None:
        while node.parent is not None and not node.cont.table and not node.moves:
            parent = node.parent
            mv = parent.moves[node.move_key]
            del mv.table[node.cls]
            if not mv.table:
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
            k: Any = value
        else:
            value = strip(preserve(value))
            k = key(value)  # an int: big ones salted (their raw hashes can be made to collide)
        bag = self.bag
        if delta > 0:
            free = self._free
            slots = self._slots
            vid = free[-1] if free else len(slots)
            old = bag.setdefault(k, vid)  # one hash for lookup and insertion
            if old != vid:
                extra = self.extra
                extra[old] = extra.get(old, 0) + delta
                return False
            if self._busy:
                del bag[k]
                self._enter()
            if delta > 1:
                self.extra[vid] = delta - 1
            if free:
                free.pop()
                slots[vid] = value
            else:
                slots.append(value)
            sink = self.sink
            fire: list[Any] = [] if sink is None else sink
            self._busy = True
            try:
                root = self.root
                if root.cont.groups:  # (the root keeps no cache: its ids are the bag's)
                    _add_at(root.cont, vid, value, fire, slots)
                if root.move_list:
                    nxt = root.move_list[0].table.get(_class(value))
                    if nxt is not None:
                        if nxt.move_list:
                            for n in _reached(nxt, value):
                                n.cont.cache[vid] = None
                                _add_at(n.cont, vid, value, fire, slots)
                        else:
                            nxt.cont.cache[vid] = None
                            _add_at(nxt.cont, vid, value, fire, slots)
            finally:
                self._busy = False
            if sink is None:
                _fire(fire)
            return True
        if delta == 0:
            return False
        got = bag.get(k)
        if got is None:
            return False
        vid = got
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
        slots = self._slots
        v = slots[vid]
        slots[vid] = None
        self._free.append(vid)
        sink = self.sink
        fire = [] if sink is None else sink
        self._busy = True
        try:
            root = self.root
            if root.cont.groups:
                _del_at(root.cont, vid, v, fire)
            if root.move_list:
                nxt = root.move_list[0].table.get(_class(v))
                if nxt is not None:
                    if nxt.move_list:
                        for n in _reached(nxt, v):
                            del n.cont.cache[vid]
                            _del_at(n.cont, vid, v, fire)
                    else:
                        del nxt.cont.cache[vid]
                        _del_at(nxt.cont, vid, v, fire)
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
                _msg_at(root.cont, value, fire)
            if root.move_list:
                nxt = root.move_list[0].table.get(_class(value))
                if nxt is not None:
                    if nxt.move_list:
                        for n in _reached(nxt, value):
                            if n.cont.has_msg:
                                _msg_at(n.cont, value, fire)
                    elif nxt.cont.has_msg:
                        _msg_at(nxt.cont, value, fire)
        finally:
            self._busy = False
        if sink is None:
            _fire(fire)

    def message_matches(self, value: Value) -> list[tuple[_Handler, tuple[Any, ...]]]:
        """The handlers a message ``value`` reaches, in the order :meth:`send_message`
        fires them, each with its callbacks that hear messages (what a message router
        caches).  Does not fire anything."""
        if type(value) not in _PLAIN:
            value = strip(preserve(value))
        out: list[tuple[_Handler, tuple[Any, ...]]] = []
        root = self.root
        if root.cont.has_msg:
            _match_at(root.cont, value, out)
        if root.move_list:
            nxt = root.move_list[0].table.get(_class(value))
            if nxt is not None:
                for n in _reached(nxt, value):
                    if n.cont.has_msg:
                        _match_at(n.cont, value, out)
        return out

    def message_patterns(self) -> list[tuple[Pattern, int]]:
        """Every handler's pattern with how many of its callbacks hear messages (those
        with some)."""
        out = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            for grp in n.cont.groups:
                for leaf in grp.leaves.values():
                    for h in leaf.hlist:
                        if h.mcbs:
                            out.append((h.pattern, len(h.mcbs)))
            for mv in n.move_list:
                stack.extend(mv.table.values())
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

    def __len__(self) -> int:
        """How many distinct assertions are present."""
        return len(self.bag)

    def count(self, value: Value) -> int:
        """How many copies of ``value`` are asserted."""
        vid = self.bag.get(self._bag_key(value))
        return 0 if vid is None else 1 + self.extra.get(vid, 0)

    def assertions(self) -> list[Value]:
        """The distinct assertions present (in the order they were added)."""
        slots = self._slots
        return [slots[vid] for vid in self.bag.values()]

    def compact(self) -> None:
        """Give back the memory of tables that were once large (a Python dict never
        shrinks by itself when entries are deleted); O(size), for after a big release."""
        self.bag = dict(self.bag)
        self.extra = dict(self.extra)
        slots = self._slots
        n = len(slots)
        while n and slots[n - 1] is None:
            n -= 1
        if n < len(slots):
            del slots[n:]
            self._free = [i for i in self._free if i < n]
        self._slots = list(slots)
        self._free = list(self._free)
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.cont.cache = dict(node.cont.cache)
            for grp in node.cont.groups:
                grp.leaves = dict(grp.leaves)
                grp.msg = dict(grp.msg)
                for leaf in grp.leaves.values():
                    leaf.cache = dict(leaf.cache)
                    for h in leaf.handlers.values():
                        h.bag = dict(h.bag)
                        h.extra = dict(h.extra)
            for mv in node.move_list:
                stack.extend(mv.table.values())

    def stats(self) -> dict[str, int]:
        """Sizes of every part of the index (for memory tests and diagnostics)."""
        s = {"assertions": len(self.bag), "nodes": 0, "shapes": 0, "groups": 0, "leaves": 0,
             "handlers": 0, "callbacks": 0, "cached": 0, "compiled": 0}
        stack = [self.root]
        while stack:
            n = stack.pop()
            s["nodes"] += 1
            if n.cont.table:
                s["shapes"] += 1  # a node where some pattern's shape ends
            s["compiled"] += len(n.compiled)
            s["cached"] += len(n.cont.cache)
            for grp in n.cont.groups:
                s["groups"] += 1
                for leaf in grp.leaves.values():
                    s["leaves"] += 1
                    s["cached"] += len(leaf.cache) + (leaf.one >= 0)
                    for h in leaf.handlers.values():
                        s["handlers"] += 1
                        s["callbacks"] += len(h.callbacks)
                        s["cached"] += len(h.bag) + (h.k1 is not _NO)
            for mv in n.move_list:
                stack.extend(mv.table.values())
        return s


def _fire(fire: list[Any]) -> None:
    for event, callbacks, caps in fire:
        for cb in callbacks:
            cb(event, caps)


def _reached(first: _Node, v: Any) -> list[_Node]:
    """The nodes ``v`` reaches from ``first`` (the node of its class), in depth-first
    order: each node's moves are followed in turn, a move to the class of what is at its
    position.  Iterative: the trie can be as deep as a pattern has compound positions."""
    out: list[_Node] = []
    todo: list[tuple[_Node, list[Any]]] = [(first, [v, v])]
    while todo:
        node, stack = todo.pop()
        out.append(node)
        ml = node.move_list
        if not ml:
            continue
        kids: list[tuple[_Node, list[Any]]] = []
        for mv in ml:
            up = mv.up
            base = stack if up == 0 else stack[: len(stack) - up]
            child = mv.step.get(base[-1])
            if child is not None:
                nxt = mv.table.get(_class(child))
                if nxt is not None:
                    st = list(base)
                    st.append(child)
                    kids.append((nxt, st))
        for i in range(len(kids) - 1, -1, -1):
            todo.append(kids[i])
    return out


# What an assertion or message does at each node it reaches (seed 000's ``modify``,
# specialised per operation).  Callbacks are collected in ``fire`` and invoked after the
# index is consistent again.


def _add_at(cont: _Continuation, k: int, v: Any, fire: list[Any], slots: list[Any]) -> None:
    for grp in cont.groups:
        ck = grp.project.get(v)
        if ck is None:
            continue
        leaves = grp.leaves
        leaf = leaves.get(ck)
        if leaf is None:
            leaf = leaves[ck] = _Leaf()
        if leaf.one < 0:
            leaf.one = k
        else:
            leaf.cache[k] = None
        for handler in leaf.hlist:
            caps = handler.project.get(v)
            if caps is None:
                continue
            if handler.exact:
                r: Record = v  # (an exact handler's values are records)
                if len(r.fields) == handler.arity:
                    cbs = handler.cbs
                    if cbs:
                        fire.append(("+", cbs, caps))
                    continue
                handler.to_bag(leaf, slots, k)
            if handler.add(_caps_key(caps), caps):
                cbs = handler.cbs
                if cbs:
                    fire.append(("+", cbs, caps))


def _del_at(cont: _Continuation, k: int, v: Any, fire: list[Any]) -> None:
    for grp in cont.groups:
        ck = grp.project.get(v)
        if ck is None:
            continue
        leaves = grp.leaves
        leaf = leaves.get(ck)
        if leaf is None:
            continue
        if leaf.one == k:
            leaf.one = -1
        else:
            del leaf.cache[k]
        for handler in leaf.hlist:
            caps = handler.project.get(v)
            if caps is None:
                continue
            if handler.exact:  # (then every value here with captures is exact)
                cbs = handler.cbs
                if cbs:
                    fire.append(("-", cbs, caps))
                continue
            gone = handler.remove(_caps_key(caps))
            if gone is not None:
                cbs = handler.cbs
                if cbs:
                    fire.append(("-", cbs, gone))
        if leaf.one < 0 and not leaf.hlist and not leaf.cache:
            del leaves[ck]


def _msg_at(cont: _Continuation, v: Any, fire: list[Any]) -> None:
    for grp in cont.groups:
        msg = grp.msg
        if not msg:
            continue  # assertion-only handlers
        ck = grp.project.get(v)
        if ck is None:
            continue
        hs = msg.get(ck)
        if hs is None:
            continue
        for h in hs:
            caps = h.project.get(v)
            if caps is not None:
                fire.append(("!", h.mcbs, caps))


def _match_at(cont: _Continuation, v: Any, out: list[tuple[_Handler, tuple[Any, ...]]]) -> None:
    """:func:`_msg_at` collecting the handlers reached instead of firing them."""
    for grp in cont.groups:
        msg = grp.msg
        if not msg:
            continue
        ck = grp.project.get(v)
        if ck is None:
            continue
        hs = msg.get(ck)
        if hs is None:
            continue
        for h in hs:
            if h.project.get(v) is not None:
                out.append((h, h.mcbs))
