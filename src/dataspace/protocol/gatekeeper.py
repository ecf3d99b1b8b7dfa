"""The gatekeeper: turns sturdyrefs into live references (gatekeeper.prs, sturdy.prs).

A connected peer sees the gatekeeper at OID 0 and asserts::

    <resolve <ref {oid: OID sig: SIG caveats: [...]}> #:observer>

The gatekeeper looks up the keys bound to ``OID`` (:class:`Bindings`), checks the
signature (chained HMAC-BLAKE2s, :func:`dataspace.protocol.sturdy.validate`) and answers
by asserting to ``observer`` either

* ``<accepted #:ref>`` -- ``ref`` reaches the bound target; when the sturdyref carries
  caveats, ``ref`` is an :class:`~dataspace.protocol.sturdy.AttenuatedEntity`, so the
  caveats are enforced *here*, for every assertion and message sent through it; or
* ``<rejected detail>`` -- and then calls ``on_rejected(message, detail)`` (the broker
  closes the connection with an ``<error ...>``).

Retracting the ``resolve`` retracts the answer.

A peer may also name itself, for the people monitoring the server, by asserting
``<client-name "NAME">`` to the gatekeeper (our client does, before its resolve, when
given a name).  The Syndicate protocol has no field for this: the gatekeeper object is
the one place every connection reaches before it has any capability, and other
gatekeepers ignore assertions they do not understand, as this one does, so clients that
send no name (syndicate-py's) and servers that know no names are unaffected.  The name is
cut to :data:`MAX_CLIENT_NAME` characters, control characters dropped; the newest name
asserted wins.  Other assertions to the gatekeeper are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..dataspace import Entity, fresh_handle
from ..values import Embedded, Record, Symbol, Value, key
from .sturdy import AttenuatedEntity, Attenuation, SturdyError, SturdyRef, validate
from .wire import short

__all__ = ["ACCEPTED", "CLIENT_NAME", "MAX_CLIENT_NAME", "REJECTED", "RESOLVE", "Binding",
           "Bindings", "Gatekeeper", "client_name"]

log = logging.getLogger(__name__)

RESOLVE = Symbol("resolve")
ACCEPTED = Symbol("accepted")
REJECTED = Symbol("rejected")
CLIENT_NAME = Symbol("client-name")

MAX_CLIENT_NAME = 100
"""The longest client name kept (characters); longer ones are cut."""


def client_name(value: Value) -> str | None:
    """The name in a ``<client-name "NAME">`` assertion, cleaned for display (control
    characters dropped, cut to :data:`MAX_CLIENT_NAME`), or None if it is not one."""
    if type(value) is not Record or value.label != CLIENT_NAME or len(value.fields) != 1:
        return None
    name = value.fields[0]
    if type(name) is not str:
        return None
    name = "".join(c for c in name[: 4 * MAX_CLIENT_NAME] if c.isprintable()).strip()
    return name[:MAX_CLIENT_NAME] or None


@dataclass(frozen=True)
class Binding:
    """``oid`` signed with ``key`` gives access to ``target``."""

    oid: Value
    key: bytes
    target: Entity
    name: str = ""


class Bindings:
    """The sturdyref bindings of a server: OID -> (key, target) pairs.

    Several keys may be bound to one OID (e.g. while rotating keys); a sturdyref is
    accepted if its signature validates under any of them.
    """

    def __init__(self) -> None:
        self._by_oid: dict[Any, list[Binding]] = {}

    def bind(self, oid: Value, secret: bytes, target: Entity, name: str = "") -> Binding:
        b = Binding(oid, bytes(secret), target, name)
        self._by_oid.setdefault(key(oid), []).append(b)
        return b

    def lookup(self, oid: Value) -> list[Binding]:
        try:
            return self._by_oid.get(key(oid), [])
        except TypeError:
            return []

    def __len__(self) -> int:
        return sum(map(len, self._by_oid.values()))

    def __iter__(self) -> Iterator[Binding]:
        for bs in self._by_oid.values():
            yield from bs


class Gatekeeper(Entity):
    """The entity at OID 0 of a server connection (see the module docstring).

    One per connection: ``on_rejected`` and the ``accepted``/``rejected`` counters are
    that connection's.
    """

    def __init__(
        self,
        bindings: Bindings,
        *,
        on_rejected: Callable[[str, Value], None] | None = None,
        on_accepted: Callable[[Binding, SturdyRef], None] | None = None,
        on_name: Callable[[str | None], None] | None = None,
    ) -> None:
        self.bindings = bindings
        self.on_rejected = on_rejected
        self.on_accepted = on_accepted
        self.on_name = on_name
        self._name_handle: int | None = None
        self.accepted = 0
        self.rejected = 0
        self._answers: dict[int, tuple[Entity, int]] = {}

    def on_assert(self, value: Value, handle: int) -> None:
        if type(value) is Record and value.label == CLIENT_NAME:
            name = client_name(value)
            if name is not None:
                self._name_handle = handle
                if self.on_name is not None:
                    self.on_name(name)
            return
        if type(value) is not Record or value.label != RESOLVE:
            if log.isEnabledFor(logging.DEBUG):  # short() of a peer's value is not free
                log.debug("gatekeeper: ignoring assertion %s", short(value))
            return
        if len(value.fields) != 2 or type(value.fields[1]) is not Embedded:
            self._reject(None, handle, f"malformed resolve request {short(value)}: expected "
                         "<resolve <ref {oid: ... sig: ...}> #:observer>", Symbol("malformed"))
            return
        step, obs = value.fields
        observer = obs.value
        if not isinstance(observer, Entity):
            self._reject(None, handle, "the observer of a resolve request is not a reference",
                         Symbol("malformed"))
            return
        try:
            ref = SturdyRef.from_value(step)
        except SturdyError as e:
            self._reject(observer, handle, f"not a sturdyref: {e}", "malformed sturdyref")
            return
        bindings = self.bindings.lookup(ref.oid)
        if not bindings:
            self._reject(observer, handle, f"no object {short(ref.oid)} on this server",
                         "unknown oid")
            return
        binding = next((b for b in bindings if validate(ref, b.key)), None)
        if binding is None:
            self._reject(observer, handle, f"invalid signature for {short(ref.oid)}: the "
                         "sturdyref was not made with this server's key", "invalid signature")
            return
        target: Entity = binding.target
        if ref.caveats:
            try:
                target = AttenuatedEntity(target, Attenuation(ref.caveats))
            except SturdyError as e:
                self._reject(observer, handle, f"invalid caveat: {e}", "invalid caveat")
                return
        h = fresh_handle()
        self._answers[handle] = (observer, h)
        self.accepted += 1
        log.debug("gatekeeper: accepted %s", short(ref.oid))
        if self.on_accepted is not None:
            self.on_accepted(binding, ref)
        observer.on_assert(Record._make(ACCEPTED, (Embedded(target),)), h)

    @property
    def pending(self) -> int:
        """Assertions the peer holds at the gatekeeper: its resolve requests (each
        answered) and its name, if it gave one."""
        return len(self._answers) + (self._name_handle is not None)

    def answered(self) -> list[Entity]:
        """The observer of each answer asserted now (one per pending request)."""
        return [observer for observer, _h in self._answers.values()]

    def on_retract(self, handle: int) -> None:
        if handle == self._name_handle:
            self._name_handle = None
            if self.on_name is not None:
                self.on_name(None)
            return
        answer = self._answers.pop(handle, None)
        if answer is not None:
            observer, h = answer
            observer.on_retract(h)

    def _reject(self, observer: Entity | None, handle: int, message: str, detail: Value) -> None:
        self.rejected += 1
        log.info("gatekeeper: rejected: %s", message)
        if observer is not None:
            h = fresh_handle()
            self._answers[handle] = (observer, h)
            observer.on_assert(Record._make(REJECTED, (detail,)), h)
        if self.on_rejected is not None:
            self.on_rejected(message, detail)
