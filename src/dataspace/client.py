"""A remote dataspace: the :class:`~dataspace.dataspace.Dataspace` API over the network.

>>> import asyncio
>>> from dataspace.client import connect
>>> async def main():                                             # doctest: +SKIP
...     ds = await connect("127.0.0.1:7411")     # cap: the data directory's root.sturdyref
...     ds.observe("<Present $who>", on_assert=print, on_retract=print)
...     h = ds.assert_(parse('<Present "alice">'))
...     ds.send(parse('<Says "alice" "hi">'))
...     await ds.sync()                          # the server has seen all of the above
...     await ds.close()

The API mirrors the in-process dataspace: :meth:`~RemoteDataspace.assert_`,
:meth:`~RemoteDataspace.retract`, :meth:`~RemoteDataspace.send`,
:meth:`~RemoteDataspace.observe`, :meth:`~RemoteDataspace.during` and
:meth:`~RemoteDataspace.turn`; plus the asynchronous :meth:`~RemoteDataspace.sync`,
:meth:`~RemoteDataspace.drain` and :meth:`~RemoteDataspace.close`.  Callbacks run in the
event loop.

Sending
    Outside a turn every call is its own Turn packet; ``with ds.turn(): ...`` sends
    everything done in the block as one packet when it ends (additions, then removals,
    then messages; an assertion made and retracted inside the block is never sent; if
    the block raises, nothing is sent).  Packets written during one iteration of the
    event loop share a socket write.  Sending never blocks: call ``await ds.drain()`` in
    long loops to wait while the server is slower than you (back-pressure).

Reconnecting
    If the connection drops, the client reconnects with exponential backoff (0.05 s
    doubling to 5 s, with jitter).  Observers are told of the gap: every match they
    hold is retracted when the connection is lost, and the current state is asserted
    afresh once it is back.  Held assertions (and subscriptions) are re-asserted.
    Messages sent while disconnected are dropped (counted in :attr:`dropped_messages`):
    a message only reaches observers present when it is delivered.

Several addresses (a cluster)
    ``connect(["a:7411", "b:7411"])`` (or ``"a:7411,b:7411"``, or ``DATASPACE_SERVER``
    with commas) connects to the first member that answers; when its connection drops,
    the client tries the next member at once, then each in turn, with the backoff
    between rounds (docs/cluster.md): it fails over, re-asserts and tells its observers
    of the gap, as above.  The members must accept the same capability (they share
    their root key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import ssl
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from .datadir import ROOT_STURDYREF, resolve_data_dir
from .dataspace import _MISSING, Entity, Facet, Handle, _DataspaceBase, fresh_handle
from .net.address import DEFAULT_HOST, DEFAULT_PORT, Address, AddressError, parse_address
from .net.connection import Connection
from .net.dial import dial, explain_early_close
from .net.flow import FlowLimits, Hub
from .net.probe import explain_mismatch, explain_unix, explain_url
from .net.sniff import what_answered
from .net.tls import ClientTLS, TLSError
from .pattern import Pattern
from .protocol.gatekeeper import ACCEPTED, CLIENT_NAME, REJECTED, RESOLVE
from .protocol.relay import Relay, RelayLimits, RemoteEntity
from .protocol.sturdy import SturdyError, SturdyRef
from .protocol.wire import short
from .values import Embedded, Record, Sequence, Value, preserve

__all__ = [
    "CapabilityError",
    "CapabilityMissing",
    "CapabilityRejected",
    "RemoteDataspace",
    "RemoteSubscription",
    "connect",
    "default_address",
    "load_capability",
    "parse_addresses",
]

log = logging.getLogger(__name__)

CLIENT_RELAY_LIMITS = RelayLimits(
    max_packet_size=64 << 20,
    max_assertions=10_000_000,
    max_imports=1_000_000,
    max_outbound_packet=256 * 1024,
    strict=False,
)
"""A client trusts its server more than a server trusts its clients."""

CLIENT_FLOW = FlowLimits(
    max_debt=64 << 20, max_send_queue=64 << 20, send_timeout=0.0, handshake_timeout=0.0
)


class CapabilityError(ValueError):
    """No usable sturdyref (missing file, bad text)."""


class CapabilityMissing(CapabilityError):
    """No sturdyref was given and the data directory has none: ``path`` does not exist."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"no capability: {path} does not exist; start the server with `dataspace serve` "
            "(it writes that file), pass the server's data directory (data_dir=...), or "
            "pass a sturdyref (cap=...)"
        )
        self.path = path


class CapabilityRejected(PermissionError):
    """The server's gatekeeper rejected the sturdyref."""

    def __init__(self, detail: Value) -> None:
        super().__init__(f"the server rejected the capability: {short(detail)}")
        self.detail = detail


def default_address() -> str:
    """``$DATASPACE_SERVER``, or the local server's default address."""
    return os.environ.get("DATASPACE_SERVER") or f"{DEFAULT_HOST}:{DEFAULT_PORT}"


def _secure(addr: Address) -> str:
    if addr.kind == "ws":
        return str(addr.with_kind("wss"))
    return f"tls://{addr.host_port}" if addr.kind == "tcp" else "tls://HOST:PORT or wss://HOST:PORT/"


def load_capability(cap: SturdyRef | str | Value | None = None, *, data_dir: str | Path | None = None) -> SturdyRef:
    """A sturdyref from ``cap`` (a SturdyRef, its Preserves text or value), or by default
    from the data directory's ``root.sturdyref`` (written by ``dataspace serve``)."""
    if isinstance(cap, SturdyRef):
        return cap
    try:
        if cap is None:
            path = resolve_data_dir(data_dir, create=False) / ROOT_STURDYREF
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError:
                raise CapabilityMissing(path) from None
            except OSError as e:
                raise CapabilityError(f"cannot read {path}: {e.strerror}") from None
            return SturdyRef.parse(text)
        if isinstance(cap, str):
            return SturdyRef.parse(cap)
        return SturdyRef.from_value(cap)
    except SturdyError as e:
        raise CapabilityError(f"not a usable sturdyref: {e}") from None



def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("callback %r failed", fn)


# ---------------------------------------------------------------------------------------
# Entities the client exports


class _Resolver(Entity):
    def __init__(self, fut: asyncio.Future[RemoteEntity]) -> None:
        self.fut = fut

    def on_assert(self, value: Value, handle: int) -> None:
        if self.fut.done() or type(value) is not Record:
            return
        if value.label == ACCEPTED and value.fields and type(value.fields[0]) is Embedded:
            self.fut.set_result(value.fields[0].value)
        elif value.label == REJECTED:
            self.fut.set_exception(CapabilityRejected(value.fields[0] if value.fields else False))


class _SyncPeer(Entity):
    def __init__(self, fut: asyncio.Future[None]) -> None:
        self.fut = fut

    def on_message(self, value: Value) -> None:
        if not self.fut.done():
            self.fut.set_result(None)


class _Observer(Entity):
    """Receives captures (as sequences) for one subscription; counts duplicates."""

    def __init__(self, sub: RemoteSubscription) -> None:
        self.sub = sub
        self.handles: dict[int, Value] = {}
        self.counts: dict[Value, int] = {}

    def on_assert(self, value: Value, handle: int) -> None:
        sub = self.sub
        if not sub.live:
            return
        self.handles[handle] = value
        n = self.counts.get(value, 0)
        self.counts[value] = n + 1
        if n == 0 and sub.on_assert is not None:
            sub.ds._callback(sub, sub.on_assert, value)

    def on_retract(self, handle: int) -> None:
        value = self.handles.pop(handle, None)
        if value is None:
            return
        n = self.counts.get(value, 0) - 1
        if n > 0:
            self.counts[value] = n
            return
        self.counts.pop(value, None)
        sub = self.sub
        if sub.live and sub.on_retract is not None:
            sub.ds._callback(sub, sub.on_retract, value)

    def on_message(self, value: Value) -> None:
        sub = self.sub
        if sub.live and sub.on_message is not None:
            sub.ds._callback(sub, sub.on_message, value)

    def reset(self) -> None:
        """The connection is gone: retract every match still held."""
        for h in list(self.handles):
            self.on_retract(h)


class RemoteSubscription:
    """An active remote observer: :meth:`cancel` ends it."""

    def __init__(
        self,
        ds: RemoteDataspace,
        pattern: Pattern,
        on_assert: Callable[..., Any] | None,
        on_retract: Callable[..., Any] | None,
        on_message: Callable[..., Any] | None,
        facet: Facet | None,
    ) -> None:
        self.ds = ds
        self.pattern = pattern
        self.on_assert = on_assert
        self.on_retract = on_retract
        self.on_message = on_message
        self.facet = facet
        self.live = True
        self.handle: int | None = None
        self.entity = _Observer(self)
        self._during: dict[Value, Facet] | None = None

    def cancel(self) -> None:
        """Stop observing (retracts the ``<Observe ...>``; ends ``during`` facets)."""
        self.ds._cancel(self)

    def __repr__(self) -> str:
        return f"<RemoteSubscription {self.pattern}>"


# ---------------------------------------------------------------------------------------
# The remote dataspace


class RemoteDataspace(_DataspaceBase):
    """A dataspace on a server (see the module docstring).  Make one with :func:`connect`."""

    def __init__(
        self,
        address: Address | list[Address],
        cap: SturdyRef,
        *,
        reconnect: bool = True,
        connect_timeout: float = 10.0,
        backoff: tuple[float, float] = (0.05, 5.0),
        flow: FlowLimits | None = None,
        relay_limits: RelayLimits | None = None,
        rng: random.Random | None = None,
        name: str | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        self.addresses = [address] if isinstance(address, Address) else list(address)
        """The server's addresses (several: members of a cluster, tried in turn)."""
        if not self.addresses:
            raise ValueError("a client needs at least one server address")
        self._at = 0
        self.client_name = name
        """The name this client gives the server (shown by ``dataspace top``, the
        inspector and ``/api/connections``), or None."""
        self.cap = cap
        secure = any(a.secure for a in self.addresses)
        self.tls = tls if tls is not None or not secure else ClientTLS.from_env()
        """What the client trusts on ``tls://`` and ``wss://`` addresses."""
        # Built once (bad files fail here, not in the reconnect loop).
        self._ssl: ssl.SSLContext | None = (
            self.tls.ssl_context() if secure and self.tls is not None else None)
        self.reconnect = reconnect
        self.connect_timeout = connect_timeout
        self.backoff = backoff
        self.flow = flow or CLIENT_FLOW
        self.relay_limits = relay_limits or CLIENT_RELAY_LIMITS
        self._rng = rng or random.Random()
        self._hub = Hub()
        self.name = ",".join(map(str, self.addresses))
        self._init_base()  # turns, facets, and the held assertions (self._values)
        self._subs: set[RemoteSubscription] = set()
        self._conn: Connection | None = None
        self._relay: Relay | None = None
        self._ref: RemoteEntity | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._closed = asyncio.Event()
        self.error: BaseException | None = None
        """Why the client stopped for good (e.g. the capability was rejected)."""
        self.lost: str | None = None
        """Why the last connection was lost (the server's reason when it gave one, e.g.
        ``"it closed the connection: the stream store failed ..."``), or None."""
        self.dropped_messages = 0
        self.reconnects = 0
        self.on_disconnect: list[Callable[[], Any]] = []
        """Called when the connection is lost (not when :meth:`close` ends it)."""
        self.on_reconnect: list[Callable[[], Any]] = []
        """Called when a lost connection is back."""
        self.failovers = 0
        """Reconnections made to another address than the one lost."""
        self.refused = 0
        """Assertions the server refused (its memory budget was full)."""
        self.on_refused: list[Callable[[Value, str], Any]] = []
        """Called with ``(value, message)`` for each assertion the server refused; the
        assertion is no longer held (it is retracted, a subscription cancelled)."""

    # -- connection ----------------------------------------------------------------------

    @property
    def address(self) -> Address:
        """The address connected to (or tried next)."""
        return self.addresses[self._at]

    async def _connect_any(self, start: int | None = None) -> None:
        """Connect to the first address that answers, from ``start`` (default: the
        current one) round the list; raises the first address's error if none does
        (:class:`CapabilityRejected` only if every one rejected the capability)."""
        n = len(self.addresses)
        first = self._at if start is None else start % n
        errors: list[BaseException] = []
        for i in range(n):
            self._at = (first + i) % n
            try:
                await self._connect_once()
                return
            except (OSError, ConnectionError) as e:
                errors.append(e)
                if n > 1:
                    log.info("%s: %s", self.address, e)
        self._at = first
        rejected = [e for e in errors if isinstance(e, CapabilityRejected)]
        if len(rejected) == n:
            raise rejected[0]
        raise next(e for e in errors if not isinstance(e, CapabilityRejected))

    @property
    def connected(self) -> bool:
        return self._ref is not None

    async def _open(self) -> Connection:
        return await dial(self.address, self._hub, self.flow, self._session,
                          self.relay_limits.max_packet_size, tls=self.tls, context=self._ssl)

    def _session(self, conn: Connection) -> Relay:
        relay = Relay(limits=self.relay_limits, name=f"client:{self.address}")
        relay.on_refused = lambda h, msg, _detail: self._refused(conn, h, msg)
        return relay

    def _refused(self, conn: Connection, handle: int, message: str) -> None:
        """The server did not take the assertion under ``handle`` (``<refused ...>``): it
        is dropped here too (a later reconnect does not assert it again)."""
        value = self._values.get(handle)
        if value is None:
            if conn is not self._conn and not conn.closed:  # the resolve itself, connecting
                conn.close(f"the server refused to resolve the capability: {message}")
            return  # else retracted meanwhile
        self.refused += 1
        n = self.refused
        if n == 1 or (n % 10 == 0 and str(n).rstrip("0") == "1"):  # 1, 10, 100, ...
            log.error("%s refused the assertion %s: %s%s", self.address, short(value, 80),
                      message, f" ({n} refused so far)" if n > 1 else "")
        sub = next((s for s in self._subs if s.handle == handle), None)
        if sub is not None:
            self._cancel(sub)
        else:
            self.retract(handle)
        for fn in self.on_refused:
            _call(fn, (value, message))

    async def _connect_once(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn = await asyncio.wait_for(self._open(), self.connect_timeout)
        except TimeoutError:
            raise ConnectionError(f"timed out connecting to {self.address}") from None
        relay = conn.relay
        assert relay is not None
        fut: asyncio.Future[RemoteEntity] = loop.create_future()
        gk = relay.import_ref(0)
        if self.client_name:
            # Our name, for the server's monitoring (see protocol.gatekeeper): in the
            # same packet as the resolve, so the server knows it from the start.
            gk.on_assert(Record._make(CLIENT_NAME, (self.client_name,)), fresh_handle())
        gk.on_assert(
            Record._make(RESOLVE, (self.cap.to_value(), Embedded(_Resolver(fut)))), fresh_handle()
        )
        self._hub.flush(None)
        closed = loop.create_task(conn.wait_closed())
        try:
            await asyncio.wait({fut, closed}, timeout=self.connect_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if not fut.done():
            fut.cancel()
            closed_early = conn.closed and not relay.peer_error and not conn.head
            why = self._handshake_failure(conn, relay)
            conn.close("no answer from the gatekeeper")
            if closed_early or (relay.error is not None and not relay.peer_error):
                # Another kind of port (a WebSocket or HTTP one): say which (net.probe).
                other = await explain_mismatch(self.address)
                if other is not None:
                    raise ConnectionError(other)
            tls_why = await explain_early_close(self.address, conn, self.tls) if closed_early \
                else None
            if tls_why is not None:
                raise TLSError(tls_why)
            raise ConnectionError(why)
        try:
            ref = fut.result()
        except CapabilityRejected:
            conn.close("capability rejected")
            raise
        if not isinstance(ref, RemoteEntity):
            conn.close("bad answer")
            raise ConnectionError(f"{self.address} answered the resolve with a non-reference")
        self._conn, self._relay, self._ref = conn, relay, ref
        self.lost = None
        # Re-assert what we hold (subscriptions included), as one packet.
        for h, v in self._values.items():
            ref.on_assert(v, h)
        self._hub.flush(None)
        conn.on_close.append(self._lost)
        self._connected.set()

    def _handshake_failure(self, conn: Connection, relay: Relay) -> str:
        """Why the capability was not resolved, saying what answered when it was not a
        Syndicate server (the first bytes it sent tell: HTTP, TLS ...)."""
        if relay.peer_error:  # the server said why, in an <error> packet
            return f"{self.address} did not accept the capability: {relay.peer_error[0]}"
        a = self.address
        port_hint = (f"the broker's TCP port is {DEFAULT_PORT} by default; a WebSocket "
                     "port (--ws) is reached as ws://HOST:PORT/")
        if a.kind == "unix" and (relay.error is not None or not conn.head):
            if relay.error is None:
                said = "closed the connection without answering" if conn.closed else \
                    f"did not answer within {self.connect_timeout:g} s"
                return f"{a} {said}: is it a dataspace server's --unix socket?"
            return (f"{a} is not a dataspace server: {what_answered(conn.head, 'socket')}, "
                    "not the Syndicate protocol (give the path of the server's --unix socket)")
        if relay.error is not None:  # what it sent is not the Syndicate protocol
            answered = what_answered(conn.head)
            if answered.endswith("HTTP"):
                hint = f" (is it the --http port, or a --ws port? {port_hint})"
            else:
                hint = f" ({port_hint})"
            return f"{a} is not a dataspace server: {answered}, not the Syndicate protocol{hint}"
        if not conn.head:
            if conn.closed:
                return (f"{a} closed the connection without answering: is it a dataspace "
                        f"server's port? ({port_hint})")
            return (f"no answer from {a} within {self.connect_timeout:g} s: is it a "
                    f"dataspace server's port? (a WebSocket or HTTP port waits, silent, for "
                    f"a request of its own; {port_hint})")
        reason = conn.close_reason if conn.closed else None
        return f"{a} did not accept the capability: {reason or 'timed out'}"

    @staticmethod
    def _why_closed(conn: Connection, relay: Relay | None) -> str:
        """Why ``conn`` closed, for an error: the server's own reason when it sent one
        (an ``<error>`` packet: the store failed, a limit ...), else the connection's."""
        if relay is not None and relay.peer_error:
            return f"it closed the connection: {relay.peer_error[0]}"
        return conn.close_reason or "the connection closed"

    def _not_connected(self) -> ConnectionError:
        why = f": {self.lost}" if self.lost else ""
        return ConnectionError(f"not connected to {self.address}{why}")

    def _lost(self, conn: Connection) -> None:
        if conn is not self._conn:
            return
        self.lost = self._why_closed(conn, self._relay)
        log.info("%s: disconnected: %s", self.address, self.lost)
        self._conn = self._relay = self._ref = None
        self._connected.clear()
        # The relay has retracted what the server asserted to our observers; make sure
        # nothing is left behind (the gap is visible to observers as retractions).
        for sub in list(self._subs):
            sub.entity.reset()
        if self._closing:
            return  # closed on purpose (close()): nothing was lost
        for fn in self.on_disconnect:
            _call(fn, ())

    async def _run(self) -> None:
        lo, hi = self.backoff
        try:
            while not self._closing:
                conn = self._conn
                if conn is not None:
                    await conn.wait_closed()
                    if conn is self._conn:  # pragma: no cover - _lost runs first
                        self._lost(conn)
                if self._closing or not self.reconnect:
                    break
                delay = lo
                lost = self._at
                # With several addresses, the next one first: the one lost is likely down.
                start = lost + 1
                while not self._closing:
                    try:
                        await self._connect_any(start)
                        self.reconnects += 1
                        if self._at != lost:
                            self.failovers += 1
                            log.info("%s: reconnected (failed over from %s)", self.address,
                                     self.addresses[lost])
                        else:
                            log.info("%s: reconnected", self.address)
                        for fn in self.on_reconnect:
                            _call(fn, ())
                        break
                    except CapabilityRejected as e:
                        log.error("%s: %s", self.address, e)
                        self.error = e
                        return
                    except (OSError, ConnectionError) as e:
                        log.info("%s: reconnect failed (%s); retrying in %.2f s",
                                 self.name, e, delay)
                    start = lost
                    wait = delay * (0.5 + self._rng.random())
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._closed.wait(), wait)
                    delay = min(hi, delay * 2)
        finally:
            self._closed.set()
            self._connected.clear()

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until connected (raises TimeoutError, or the fatal error if any)."""
        if self.error is not None:
            raise self.error
        await asyncio.wait_for(self._connected.wait(), timeout)

    async def wait_closed(self) -> None:
        """Wait until the client has stopped (closed, or given up for good)."""
        await self._closed.wait()

    async def close(self) -> None:
        """Disconnect for good (the server retracts everything this client asserted)."""
        self._closing = True
        self._closed.set()
        conn = self._conn
        if conn is not None:
            self._hub.flush(None)
            conn.close("client closed")
        task = self._task
        if task is not None and task is not asyncio.current_task():
            # asyncio.wait, not wait_for: the connection task's own end (an error, its
            # cancellation) is not ours to raise, but *our* cancellation (Ctrl-C under
            # asyncio.run) must go on up rather than be swallowed here.
            await asyncio.wait({task}, timeout=5.0)
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: an error is logged by the task itself

    async def __aenter__(self) -> RemoteDataspace:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the Dataspace API ---------------------------------------------------------------

    def _flush(self) -> None:
        if self._turn_depth == 0 and not self._hub.active:
            self._hub.flush(None)

    def assert_(self, value: Value) -> int:
        """Assert ``value``; returns the handle that retracts it (held across reconnects)."""
        value = preserve(value)
        h = self._new_handle(value)
        if self._turn is not None:
            self._turn.append(("a", h, value))
            return h
        ref = self._ref
        if ref is not None:
            ref.on_assert(value, h)
            self._flush()
        return h

    def retract(self, handle: int) -> bool:
        """Retract the assertion made under ``handle``; False if it is not live."""
        value = self._drop_handle(handle)
        if value is _MISSING:
            return False
        if self._turn is not None:
            self._turn.append(("r", handle, value))
            return True
        ref = self._ref
        if ref is not None:
            ref.on_retract(handle)
            self._flush()
        return True

    def send(self, value: Value) -> None:
        """Send ``value`` as a message (dropped, and counted, while disconnected)."""
        value = preserve(value)
        if self._turn is not None:
            self._turn.append(("m", 0, value))
            return
        ref = self._ref
        if ref is None:
            self.dropped_messages += 1
            return
        ref.on_message(value)
        self._flush()

    def observe(
        self,
        pattern: Pattern | str | Value,
        on_assert: Callable[..., Any] | None = None,
        on_retract: Callable[..., Any] | None = None,
        on_message: Callable[..., Any] | None = None,
        *,
        group: str | None = None,
        rebalance: bool = False,
    ) -> RemoteSubscription:
        """Observe ``pattern`` (as :meth:`Dataspace.observe`): ``on_assert(*captures)``
        once per distinct capture tuple as matches appear, ``on_retract(*captures)`` when
        the last goes, ``on_message(*captures)`` per matching message.

        ``group``: join that group of observers at the server instead (asserts
        ``<ObserveGroup group PATTERN #:observer>``): each matching message comes to one
        member of the group, each matching assertion is a job assigned to one member
        (``on_assert``, then ``on_retract`` when it is finished or moved away), moved to
        another when this client leaves or its connection dies.  ``rebalance``: take a
        share of the jobs already assigned when joining.  See docs/broker.md, "Sharing
        work"."""
        if group is not None:
            from .groups import subscribe_group

            sub: RemoteSubscription = subscribe_group(
                self, pattern, on_assert, on_retract, on_message, group, rebalance)
            return sub
        return self._subscribe(pattern, on_assert, on_retract, on_message)

    def during(self, pattern: Pattern | str | Value, setup: Callable[..., Any]) -> RemoteSubscription:
        """For each distinct match run ``setup(*captures)`` in a facet; what it asserts
        and observes (and the callable it may return) ends when the match goes."""
        return self._subscribe(pattern, None, None, None, setup)

    def _new_subscription(self, pat: Pattern, on_assert: Any, on_retract: Any,
                          on_message: Any) -> RemoteSubscription:
        sub = RemoteSubscription(self, pat, on_assert, on_retract, on_message, self._facet)
        self._subs.add(sub)
        return sub

    def _observer_of(self, sub: Any) -> Any:
        return sub.entity

    def _apply(
        self, added: dict[Handle, Value], removed: list[tuple[Handle, Value]], messages: list[Value]
    ) -> None:
        ref = self._ref
        if ref is None:
            # Held assertions are re-asserted on reconnect; messages are lost meanwhile.
            self.dropped_messages += len(messages)
            return
        for h, v in added.items():
            ref.on_assert(v, h)
        for h, _v in removed:
            ref.on_retract(h)
        for m in messages:
            ref.on_message(m)
        self._flush()

    async def sync(self, timeout: float | None = 30.0) -> None:
        """Wait until the server has processed everything sent so far (a round trip).

        Raises ``ConnectionError`` if the connection is lost first.
        """
        ref, relay, conn, address = self._ref, self._relay, self._conn, self.address
        if ref is None or relay is None or conn is None:
            raise self._not_connected()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        relay.send_sync(ref, _SyncPeer(fut))
        self._hub.flush(None)
        closed = loop.create_task(conn.wait_closed())
        try:
            await asyncio.wait({fut, closed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if not fut.done():
            fut.cancel()
            if conn.closed:
                if relay.peer_error:  # the server said why: say it (e.g. the store failed)
                    raise ConnectionError(f"{address} closed the connection during sync: "
                                          f"{relay.peer_error[0]}")
                raise ConnectionError(f"connection to {address} lost during sync "
                                      f"({self._why_closed(conn, relay)})")
            raise TimeoutError(f"no answer to sync from {address} within {timeout:g} s")

    async def _barrier(self, timeout: float | None) -> None:
        await self.sync(timeout)

    def _check_ready(self, what: str) -> None:
        super()._check_ready(what)
        if self._ref is None:
            raise self._not_connected()

    async def drain(self) -> None:
        """Wait while the connection's send buffer is over its limit (back-pressure)."""
        conn = self._conn
        if conn is not None and not conn.closed:
            await conn.wait_writable()  # type: ignore[attr-defined]

    # -- callbacks and facets ------------------------------------------------------------

    def _callback(self, sub: RemoteSubscription, fn: Callable[..., Any], caps: Value) -> None:
        args = tuple(caps) if type(caps) is Sequence else (caps,)
        self._run_callback(fn, args, sub.facet)

    def _forget(self, sub: Any) -> None:
        self._subs.discard(sub)


def parse_addresses(address: str | Address | Seq[str | Address]) -> list[Address]:
    """Server addresses from ``"a:7411"``, ``"a:7411,b:7411"``, an :class:`Address` or a
    list of these (raises :class:`AddressError`)."""
    items = [address] if isinstance(address, str | Address) else list(address)
    out: list[Address] = []
    for item in items:
        if isinstance(item, Address):
            out.append(item)
            continue
        for part in item.split(","):
            if part.strip():
                out.append(parse_address(part.strip()))
    if not out:
        raise AddressError("no server address given")
    return out


async def connect(
    address: str | Address | Seq[str | Address] | None = None,
    cap: SturdyRef | str | Value | None = None,
    *,
    data_dir: str | Path | None = None,
    reconnect: bool = True,
    connect_timeout: float = 10.0,
    name: str | None = None,
    ssl: ssl.SSLContext | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_server_name: str | None = None,
    tls_insecure_skip_verify: bool = False,
    **options: Any,
) -> RemoteDataspace:
    """Connect to a server and resolve ``cap``; returns a :class:`RemoteDataspace`.

    * ``address`` -- ``HOST:PORT``, ``tls://HOST:PORT``, ``unix:PATH``,
      ``ws://HOST:PORT/``, ``wss://HOST:PORT/`` ... (default: ``$DATASPACE_SERVER`` or
      ``127.0.0.1:7411``); several (a list, or separated by commas) for the members of a
      cluster: the first that answers, then each in turn when the connection drops
      (failover);
    * ``cap`` -- the sturdyref (object, text or value); default: the data directory's
      ``root.sturdyref``;
    * ``reconnect`` -- reconnect with backoff when the connection drops (default True);
    * ``name`` -- what to call this client in the server's monitoring (``dataspace top``,
      the inspector, ``/api/connections``) beside its address, e.g. ``"billing-worker"``
      (at most 100 characters are kept).
    * on ``tls://`` and ``wss://`` addresses: ``ssl`` (an :class:`ssl.SSLContext` to use
      as it is), or ``tls_ca`` (the CA file to trust; default ``$DATASPACE_TLS_CA``, else
      the system's trust store), ``tls_cert`` and ``tls_key`` (a client certificate, for
      servers that ask for one; default ``$DATASPACE_TLS_CERT``/``$DATASPACE_TLS_KEY``),
      ``tls_server_name`` (the name the certificate must have; default the host) and
      ``tls_insecure_skip_verify`` (accept any certificate: tests only).

    Raises ``ConnectionError`` if the server cannot be reached (saying how to start one;
    :class:`~dataspace.net.tls.TLSError` for TLS failures, saying what to change),
    :class:`CapabilityRejected` if the gatekeeper refuses the capability,
    :class:`CapabilityError` if there is no usable capability
    (:class:`CapabilityMissing` when none was given and the data directory has none) and
    :class:`~dataspace.net.tls.TLSConfigError` for certificate files that cannot be used.
    """
    if address is None:
        address = default_address()
    try:
        addrs = parse_addresses(address)
    except AddressError as e:
        # An http:// URL: say what answers there (a WebSocket port: ws://) (net.probe).
        why = await explain_url(address) if isinstance(address, str) else None
        raise ConnectionError(why or f"bad server address: {e}") from None
    addr = addrs[0]
    tls_given = ssl is not None or any((tls_ca, tls_cert, tls_key, tls_server_name,
                                        tls_insecure_skip_verify))
    secure = [a for a in addrs if a.secure]
    if tls_given and not secure:
        raise ConnectionError(f"TLS options were given for {addr}, which is not a TLS "
                              f"address: write {_secure(addr)}")
    tls = None
    if secure:
        tls = ClientTLS.from_env(tls_ca, tls_cert, tls_key, server_name=tls_server_name,
                                 insecure_skip_verify=tls_insecure_skip_verify, context=ssl)
    ref = load_capability(cap, data_dir=data_dir)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string, not {type(name).__name__}")
    ds = RemoteDataspace(addrs, ref, reconnect=reconnect, connect_timeout=connect_timeout,
                         name=name, tls=tls, **options)
    try:
        await ds._connect_any()
    except CapabilityRejected:
        raise
    except (ConnectionRefusedError, FileNotFoundError):
        if len(addrs) > 1:
            raise ConnectionError(f"no server at any of {', '.join(map(str, addrs))}: start "
                                  "the cluster's members (`dataspace serve --cluster ...`)") from None
        not_socket = explain_unix(addr.path) if addr.kind == "unix" else None
        if not_socket is not None:
            raise ConnectionError(not_socket) from None
        default = addr.kind == "tcp" and (addr.host, addr.port) == (DEFAULT_HOST, DEFAULT_PORT)
        option = {"unix": "unix", "tcp": "tcp", "tls": "tcp"}.get(addr.kind, "ws")
        how = "dataspace serve" if default else (
            f"dataspace serve --{option} "
            f"{addr.path if addr.kind == 'unix' else addr.host_port}"
            + (" --tls-cert CERT --tls-key KEY" if addr.secure else "")
        )
        raise ConnectionError(f"no server at {addr}: start one with `{how}`") from None
    except ConnectionError:
        raise
    except OSError as e:
        raise ConnectionError(f"cannot connect to {ds.address}: {e.strerror or e}") from None
    ds._task = asyncio.get_running_loop().create_task(ds._run())
    return ds
