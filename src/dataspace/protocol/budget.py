"""The server's memory budget: the bytes clients make a server hold, in one account.

A server makes one :class:`MemoryBudget` (``--max-memory``) and gives it to every relay
(through their shared :class:`~dataspace.protocol.relay.Quota`).  Each relay charges it
for what its peer makes the server hold and releases the charge when that goes:

* every live assertion the peer made: :func:`charge` -- the bytes of the Python objects
  its value decodes to, and of the tables that hold it (the relay's handle table, the
  dataspace's bag and index), calibrated against the resident memory a real server gains
  per assertion;
* every assertion delivered to the peer's observers and held for it
  (:data:`DELIVERY_OVERHEAD` each).

The host adds what it holds outside the relays -- partly received packets, a fixed cost
per connection, scry state -- as :attr:`MemoryBudget.extra`, refreshed now and then (a
linked server's assertions are charged by the link's relay).

Past the budget a *new* assertion is refused (:meth:`MemoryBudget.admit` says why):
retractions, messages and syncs never are, so a connection can always let go of what it
holds, and probes stay served.  Two rules keep greedy clients from locking out the
others:

* past three quarters of the budget, a connection holding more than its share (the
  budget divided by the number of connections) is refused;
* a connection holding little (at most a 1024th of the budget, with the new assertion)
  may use a reserve of a 32nd of the budget beyond it, and assertions to the gatekeeper
  (resolving a capability: how a new client connects) one of a 16th: presence, leases
  and new clients are served while the greedy are refused.

Output waiting for a peer is charged too (:attr:`MemoryBudget.output`), from when it is
encoded until the host says it is sent; it may go a 16th past the budget, counted from
the most held since memory was last given back (:meth:`MemoryBudget.output_over`), past
which a connection with more than a 64th of the budget waiting is closed
(``memory-full``) rather than the burst built: the deliveries to a new observer of
everything, say.

Sans-IO: no clocks, no sockets; the numbers come in as arguments.
"""

from __future__ import annotations

import sys
from typing import Any

from ..values import Dictionary, Embedded, Record, Sequence, Set, Symbol, Value, encode

__all__ = [
    "ASSERTION_OVERHEAD",
    "DELIVERY_OVERHEAD",
    "MEMORY_FULL",
    "MemoryBudget",
    "REFUSED",
    "VALUE_FACTOR",
    "charge",
    "footprint",
    "format_bytes",
    "refused_packet",
]

REFUSED = Symbol("refused")
"""The label of the packet telling a peer one of its assertions was refused."""
MEMORY_FULL = Symbol("memory-full")

ASSERTION_OVERHEAD = 1024
"""Bytes charged per live assertion besides its value (see :func:`charge`): the relay's
handle table entry, the dataspace's bag entry and index leaves."""

VALUE_FACTOR = 1.25
"""The charge of a value's :func:`footprint` (see :func:`charge`)."""

DELIVERY_OVERHEAD = 512
"""Bytes charged per assertion held for a peer's observers: its entry in the relay's
outbound table and the dataspace's record of the match (measured: about 480 bytes per
assertion and catch-all observer)."""

_getsizeof = sys.getsizeof
_SYMBOL = 56   # the object, besides its name
_RECORD = 72   # the object, besides its fields tuple
_ENTRY = 64    # a dictionary entry or set member: its slot and key object


def footprint(v: Any) -> int:
    """The bytes of the Python objects the decoded value ``v`` is made of (each node
    counted once per occurrence; shared atoms are counted as if they were not).

    On every assertion a server accepts, so written for speed: the sizes of CPython's
    strings, bytes, small integers and tuples are computed (``sys.getsizeof`` costs
    more than the rest), atoms inside a compound are counted in place, and compounds are
    walked with a stack rather than recursion."""
    t = type(v)
    if t is not Record and t is not Sequence and t is not Dictionary and t is not Set:
        return _atom(v)
    n = 0
    stack = [v]
    pop = stack.pop
    push = stack.append
    while stack:
        v = pop()
        t = type(v)
        if t is Record:
            f = v.fields
            n += _RECORD + _TUPLE + 8 * len(f)
            lab = v.label
            if type(lab) is Symbol:
                name = lab.name
                n += _SYMBOL + (_STR + len(name) if name.isascii() else _getsizeof(name))
            else:
                push(lab)
            items: Any = f
        elif t is Sequence:
            n += _TUPLE + 8 * len(v)
            items = v
        elif t is Dictionary:
            d = v._items
            n += 64 + _getsizeof(d) + (_ENTRY + 56) * len(d)
            items = [x for pair in d.values() for x in pair]
        elif t is Set:
            d = v._items
            n += 64 + _getsizeof(d) + _ENTRY * len(d)
            items = d.values()
        else:
            n += _atom(v)
            continue
        for x in items:
            tx = type(x)
            if tx is str:
                n += _STR + len(x) if x.isascii() else _getsizeof(x)
            elif tx is int:
                n += 28 if -_SMALL < x < _SMALL else _getsizeof(x)
            elif tx is bytes:
                n += _BYTES + len(x)
            elif tx is Symbol:
                name = x.name
                n += _SYMBOL + (_STR + len(name) if name.isascii() else _getsizeof(name))
            elif tx is float:
                n += 24
            elif tx is not bool and x is not None:
                push(x)
    return n


_STR = 49     # an empty ASCII str
_BYTES = 33   # an empty bytes
_TUPLE = 40   # an empty tuple
_SMALL = 1 << 30  # ints below this in size take 28 bytes


def _atom(v: Any) -> int:
    """:func:`footprint` of a value that is not a compound."""
    t = type(v)
    if t is str or t is bytes or t is int or t is float:
        return _getsizeof(v)
    if t is Symbol:
        return _SYMBOL + _getsizeof(v.name)
    if t is bool or v is None:
        return 0
    if t is Embedded:
        return 48
    # Anything else (an annotated value, a float subclass...): its object, and what it
    # holds if it is a container.
    n = _getsizeof(v)
    if isinstance(v, tuple | list):
        for x in v:
            n += footprint(x)
    return n


def charge(v: Any) -> int:
    """What holding the assertion of ``v`` costs the budget:
    ``ASSERTION_OVERHEAD + VALUE_FACTOR * footprint(v)``.

    Calibrated against ``dataspace serve`` (under the C allocator, as it runs): it gains
    about 550 bytes of resident memory per assertion plus the value's footprint (4 x
    25,000 assertions of each of several shapes: ``<n 12>`` 800 bytes, a 2 KiB string
    2,943), and under the churn of an attack (assertions refused, retracted, asserted
    again: the allocator reuses its free memory imperfectly) about 3,600 bytes per 2 KiB
    string.  The charge (1,341 and 4,021 bytes) keeps the resident memory a tenth or more
    below the budget in both cases.
    """
    f = footprint(v)
    return ASSERTION_OVERHEAD + f + (f >> 2)


def format_bytes(n: float) -> str:
    """``512 MiB``, ``1.5 GiB``, ``300 KiB``, ``12 B``: as ``--max-memory`` accepts them."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            x = n / (1 << shift)
            return f"{x:.0f} {unit}" if x == int(x) or x >= 100 else f"{x:.1f} {unit}"
    return f"{n:.0f} B"


class MemoryBudget:
    """The bytes clients make one server hold, against a limit (see the module
    docstring).  ``limit`` is in bytes; ``option`` names the setting in refusals
    (``--max-memory``)."""

    __slots__ = ("extra", "held", "high", "limit", "option", "output", "peak", "refused",
                 "relays", "soft")

    def __init__(self, limit: int, option: str = "--max-memory") -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"a memory budget must be a positive number of bytes, not {limit!r}")
        self.limit = limit
        self.soft = limit - (limit >> 2)
        """Three quarters of the limit: below it every assertion is admitted (the relays
        check this themselves, and call :meth:`admit` past it)."""
        self.option = option
        self.held = 0
        """Bytes charged by relays for assertions and the deliveries held for observers."""
        self.output = 0
        """Bytes of output waiting for peers (charged three times from when a packet is
        built until the host has written it: it is copied twice on its way)."""
        self.extra = 0
        """Bytes the host holds for clients outside the relays (unread input, links,
        scry, a fixed cost per connection), as of its last refresh."""
        self.high = 0
        """The most :attr:`held` since the host last gave memory back to the system
        (:meth:`trimmed`): what is released stays in the process until then, so output
        (large buffers, allocated apart) is measured against this."""
        self.relays = 0
        """Relays charging this budget (connections)."""
        self.refused = 0
        """Assertions refused so far."""
        self.peak = 0
        """The largest :attr:`used` seen: by an assertion admitted past three quarters of
        the limit, or by the host's refreshes."""

    @property
    def used(self) -> int:
        """Bytes held for clients, as far as the budget knows."""
        return self.held + self.extra + self.output

    def admit(self, size: int, relay_held: int, reserve: bool = False) -> str | None:
        """None when an assertion charging ``size`` bytes may be held, for a relay
        already holding ``relay_held``; else why it is refused (one line for the peer).
        ``reserve``: the assertion may use the reserve (a gatekeeper request)."""
        used = self.held + self.extra + self.output + size
        limit = self.limit
        # The reserves are for what is held: buffers and output (transient) do not count.
        if reserve:
            ok = self.held + size <= limit + (limit >> 4)
        elif relay_held + size <= limit >> 10:
            ok = self.held + size <= limit + (limit >> 5)
        else:
            ok = used <= limit
            if ok and used > limit - (limit >> 2):  # past three quarters: shares apply
                share = limit // max(1, self.relays)
                if relay_held + size > share:
                    self.refused += 1
                    return (f"this connection holds {format_bytes(relay_held)}, more than its "
                            f"share ({format_bytes(share)}) of the server's memory budget "
                            f"({self.option} {format_bytes(self.limit)}), which is "
                            f"{100 * used // self.limit}% used: assertion refused; "
                            f"retract something or ask the operator to raise {self.option}")
        if ok:
            if used > self.peak:
                self.peak = used
            if self.held + size > self.high:
                self.high = self.held + size
            return None
        self.refused += 1
        return (f"the server's memory budget ({self.option} {format_bytes(self.limit)}) is "
                f"full: assertion refused; retract something or ask the operator to raise "
                f"{self.option}")

    def output_over(self) -> bool:
        """Whether output passes the budget and its output reserve (a 16th), on top of
        the most held since memory was last given back."""
        return (max(self.held, self.high) + self.extra + self.output
                > self.limit + (self.limit >> 4))

    def trimmed(self) -> None:
        """The host gave released memory back to the system (``malloc_trim``)."""
        self.high = self.held

    def __repr__(self) -> str:
        return (f"<MemoryBudget {format_bytes(self.used)} of {format_bytes(self.limit)}, "
                f"{self.relays} relays, {self.refused} refused>")


def refused_packet(handle: int, message: str, detail: Value = MEMORY_FULL) -> bytes:
    """``<refused handle message detail>``: the peer's assertion under ``handle`` is not
    held.  An extension packet of the Syndicate protocol, which peers that do not know it
    ignore (syndicate-py does); the connection goes on."""
    return encode(Record._make(REFUSED, (handle, message, detail)))
