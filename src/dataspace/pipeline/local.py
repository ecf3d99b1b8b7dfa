"""The local engine: runs a graph in this process over a stream store, exactly once.

Per processor step (seed 002, persistence component; ``io.point`` marks each step for
failure injection)::

    1  starts = tailer positions; pick the step's message sets (up to ``batch``):
       join = one message from each input per set, alts = merge of the inputs in commit
       order (``seq``), a retry = exactly the range [starts, ends) of the failed attempt
    2  first attempt only: append <snapshot id starts ends> to the backing stream
    3  delivery hash = BLAKE2b-128(canonical encoding of the snapshot)
    4  advance the tailers to ends (persisted tailer positions)
    4a alts, first attempt: append <snapshot-alts order>
    5  run the function on every message set (errors -> error records, or step 9)
    7  outputs/errors: append <attempt-output|attempt-error stream index hash>, then the
       messages with {src: positions, hash: h} metadata
    8  nothing written: append <attempt-nil hash>
    9  an unhandled error: the processor stops; its tailers go back to starts and the
       snapshot stays, so the step is retried after a restart (recovery 1b/1c)

Commits.  ``commit="group"`` (the default) runs many steps -- of every processor, in
topological order -- in one store transaction (committed every ``group_ms`` or when no
processor has input): since outputs, tailer positions and backing records share the
transaction, what the recovery component finds is always the end of a whole step, and a
crash rolls back to the end of the last committed group.  Side-effecting processors
(sinks) are the exception the seed calls out: their snapshot (with the step's extent and
alts order) is committed *before* the function runs, so a retry after a crash gets the
same messages and the same delivery hash.  ``commit="each-write"`` commits after every
write of the persistence component, the way a store without multi-stream transactions
behaves (Cues on Chronicle Queue); it is slower and exists to exercise every recovery
branch in tests (it assumes no other writer appends to the processor's outputs while a
step is in flight).

At-most-once (``guarantee="at-most-once"``): no snapshot, hash or attempt records; a
batch's tailer positions are committed before its function runs, and its outputs are
written with the next group (groups are sized to about ``group_ms`` of work, as for
exactly-once).  A crash loses the batches in flight; nothing is duplicated.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..streams.base import MAX_INDEX, Store, StoreLock, Transaction, encode_value
from ..values import Record, Sequence, Symbol, decode, encode
from .engine import GUARANTEES, Engine, EngineError, ProcStats, check_sources, claim_graph
from .exactly_once import (
    ATTEMPT_ERROR,
    ATTEMPT_NIL,
    ATTEMPT_OUTPUT,
    MetaEncoder,
    Recovery,
    alts_record,
    attempt_record,
    backing_stream,
    close_interrupted,
    delivery_hash,
    enc_int,
    hash_of,
    recover,
    resume,
    snapshot_record,
)
from .failure import describe_failure
from .graph import Context, Delivery, Graph, Message, Processor

__all__ = ["Crash", "LocalEngine", "POINTS"]

log = logging.getLogger(__name__)

POINTS = ("snapshot", "read", "alts-snapshot", "before-function", "function", "attempt",
          "output", "nil", "commit")
"""Failure-injection points: after each step of the persistence component, and just
before a group commit."""

_WRITE_POINTS = frozenset({"snapshot", "read", "alts-snapshot", "attempt", "output", "nil"})
_ERROR = Symbol("error")


class Crash(BaseException):
    """Raised by failure-injection hooks to simulate a crash (nothing is cleaned up)."""


class _Unhandled(Exception):
    """A function's error with nowhere to go (no error stream): ``line`` and ``detail``
    (the user's traceback) say it (:func:`.failure.describe_failure`)."""

    def __init__(self, exc: BaseException, positions: dict[str, int], line: str = "",
                 detail: str = "") -> None:
        super().__init__(line or str(exc))
        self.exc = exc
        self.positions = positions
        self.line = line or f"{type(exc).__name__}: {exc}"
        self.detail = detail


class _IO:
    """The current transaction, commit policy and fault hook of a group.

    The transaction begins at the first write (``tx``), so nothing holds the store's
    write lock while a function runs between two durable points."""

    def __init__(self, store: Store, each_write: bool, fault: Callable[[str, str], None] | None) -> None:
        self.store = store
        self.each_write = each_write
        self.fault = fault
        self._tx: Transaction | None = None

    @property
    def tx(self) -> Transaction:
        if self._tx is None:
            self._tx = self.store.begin()
        return self._tx

    def _commit(self) -> None:
        if self._tx is not None:
            tx, self._tx = self._tx, None
            tx.commit()

    def point(self, proc: str, name: str) -> None:
        if self.each_write and name in _WRITE_POINTS:
            self._commit()
        if self.fault is not None:
            self.fault(proc, name)

    def durable(self, proc: str, name: str) -> None:
        self._commit()
        if self.fault is not None:
            self.fault(proc, name)

    def commit(self) -> None:
        if self.fault is not None:
            self.fault("", "commit")
        self._commit()

    def rollback(self) -> None:
        if self._tx is not None:
            tx, self._tx = self._tx, None
            with contextlib.suppress(Exception):
                tx.rollback()


class _Step:
    """One step of a processor between planning and writing."""

    __slots__ = ("ends", "errs", "first_alts", "first_snapshot", "h", "nsets", "order", "outs",
                 "rows", "snap", "starts", "unhandled")

    def __init__(self, starts: list[int], ends: list[int], rows: list[list[Any]],
                 order: list[int] | None, snap: bytes, h: bytes, *, first_snapshot: bool,
                 first_alts: bool) -> None:
        self.starts = starts
        self.ends = ends
        self.rows = rows
        self.order = order
        self.snap = snap
        self.h = h
        self.first_snapshot = first_snapshot
        self.first_alts = first_alts
        self.outs: dict[str, tuple[list[bytes], list[bytes]]] = {}
        self.errs: tuple[list[bytes], list[bytes]] = ([], [])
        self.nsets = 0
        self.unhandled: _Unhandled | None = None


class _Proc:
    """A processor's runtime state."""

    def __init__(self, g: Graph, p: Processor, store: Store | None = None) -> None:
        self.store = store  # None: only the step function (_run) is used (the Spark writer)
        self.p = p
        self.id = g.proc_id(p)
        self.backing = backing_stream(self.id)
        self.inputs = p.inputs
        self.alts = p.reads_alts
        self.positions: list[int] = [0] * len(p.inputs)
        self.retry: Recovery | None = None
        self.skip_snapshot = False
        self.have_alts = False
        self.failed: str | None = None
        self.detail: str | None = None
        self.recovery = ""
        self.meta = MetaEncoder(p.inputs)
        self.prefix = {s: self.meta.prefix_one(s) for s in p.inputs}
        es = g.error_stream
        self.err_stream = es if es and es not in p.inputs else None
        self.consumed = 0
        self.produced = 0
        self.errors = 0
        self.steps = 0
        # What steps not committed yet add to the four counts above (they count once
        # their transaction commits: :meth:`settle`), and the state before those steps.
        self._pend = [0, 0, 0, 0]
        self._saved: tuple[Any, ...] | None = None
        # at-most-once: the batch read (positions committed) and its outputs to write
        self.amo_batches: list[Any] = []
        self.amo_pending: list[tuple[dict[str, tuple[list[bytes], list[bytes]]], tuple[list[bytes], list[bytes]]]] = []

    # -- availability -------------------------------------------------------------------

    def has_input(self, nexts: dict[str, int]) -> bool:
        if self.failed:
            return False
        if self.retry is not None:
            return True
        pos = self.positions
        if self.alts:
            return any(nexts.get(s, 0) > pos[i] for i, s in enumerate(self.inputs))
        return all(nexts.get(s, 0) > pos[i] for i, s in enumerate(self.inputs))

    # -- what is committed ------------------------------------------------------------

    def _begin(self) -> None:
        """A step (or at-most-once batch) starts: remember the state it may have to go
        back to, unless an uncommitted one already did."""
        if self._saved is None:
            self._saved = (self.positions, self.retry, self.skip_snapshot, self.have_alts,
                           len(self.amo_batches), self.amo_pending)

    def settle(self, committed: bool) -> None:
        """The transaction of the steps since the last settle committed (their counts
        join the totals), or did not (they are forgotten, and the positions and retry
        state are what the store holds: a failed read or commit counts nothing)."""
        saved, self._saved = self._saved, None
        pend, self._pend = self._pend, [0, 0, 0, 0]
        if committed:
            self.consumed += pend[0]
            self.produced += pend[1]
            self.errors += pend[2]
            self.steps += pend[3]
        elif saved is not None:
            (self.positions, self.retry, self.skip_snapshot, self.have_alts, n,
             self.amo_pending) = saved
            del self.amo_batches[n:]

    # -- step 1: choosing the message sets ----------------------------------------------

    def _read(self, tx: Any, limit: int) -> tuple[list[int], list[int], list[list[Any]], list[int] | None] | None:
        """``tx``: a transaction or the store (both have ``read_rows``/``next_index``)."""
        ins = self.inputs
        n = len(ins)
        retry = self.retry
        if retry is not None:
            assert retry.starts is not None and retry.ends is not None
            starts = [retry.starts[s] for s in ins]
            ends = [retry.ends[s] for s in ins]
            rows = [tx.read_rows(s, starts[i], ends[i], MAX_INDEX) for i, s in enumerate(ins)]
            order: list[int] | None = None
            if self.alts:
                if retry.order is not None and [len(r) for r in rows] == [
                        retry.order.count(s) for s in ins]:
                    order = [ins.index(name) for name in retry.order]
                else:
                    if retry.order is not None:
                        log.warning("%s: retention removed messages of the step being retried",
                                    self.id)
                    order = _merge_order(rows)
                return starts, ends, rows, order
            k = min(len(r) for r in rows)
            if any(len(r) != k for r in rows):
                log.warning("%s: retention removed messages of the step being retried", self.id)
                rows = [r[:k] for r in rows]
            return starts, ends, rows, None
        starts = list(self.positions)
        if self.alts:
            rows = []
            for i, s in enumerate(ins):
                avail = tx.next_index(s) - starts[i]
                rows.append(tx.read_rows(s, starts[i], MAX_INDEX, min(avail, limit)) if avail > 0 else [])
            total = sum(len(r) for r in rows)
            if total == 0:
                return None
            if total > limit or sum(1 for r in rows if r) > 1:
                merged = sorted(
                    (row[1], i, j) for i, r in enumerate(rows) for j, row in enumerate(r)
                )[:limit]
                taken = [0] * n
                order = []
                for _seq, i, _j in merged:
                    taken[i] += 1
                    order.append(i)
                rows = [r[: taken[i]] for i, r in enumerate(rows)]
            else:
                i = next(i for i, r in enumerate(rows) if r)
                order = [i] * len(rows[i])
            ends = [r[-1][0] + 1 if r else starts[i] for i, r in enumerate(rows)]
            return starts, ends, rows, order
        k = limit
        for i, s in enumerate(ins):
            avail = tx.next_index(s) - starts[i]
            if avail < k:
                k = avail
        if k <= 0:
            return None
        rows = [tx.read_rows(s, starts[i], MAX_INDEX, k) for i, s in enumerate(ins)]
        k = min(len(r) for r in rows)
        if k == 0:
            return None
        if n > 1:
            rows = [r[:k] for r in rows]
        ends = [r[-1][0] + 1 for r in rows]
        return starts, ends, rows, None

    # -- one exactly-once step, in four parts -----------------------------------------------
    #
    # plan (step 1, 3: reads only) -> write_pre (2, 4, 4a) -> compute (5) -> write_post
    # (7, 8, 9).  For side-effecting processors and with commit="each-write" they run in
    # that order, with the writes of write_pre durable before compute.  For pure
    # processors under group commit, plan and compute run *outside* the store's write
    # transaction (nothing of a pure step is observable before it commits) and the writes
    # of many steps follow in one transaction, in the seed's order: other writers (a
    # recorder, an appender) only wait for the writes, never for the functions.

    def plan(self, reader: Any, limit: int) -> _Step | None:
        """Step 1: the tailer indices, the message sets and the snapshot (3: its hash)."""
        self._begin()
        got = self._read(reader, limit)
        if got is None:
            return None
        starts, ends, rows, order = got
        ins = self.inputs
        snap = encode(snapshot_record(self.id, dict(zip(ins, starts)), dict(zip(ins, ends))))
        return _Step(starts, ends, rows, order, snap, hash_of(snap),
                     first_snapshot=not self.skip_snapshot,
                     first_alts=self.alts and not self.have_alts)

    def write_pre(self, io: _IO, st: _Step) -> None:
        """Steps 2, 4, 4a: snapshot (first attempt only), tailers, alts snapshot."""
        pid = self.id
        ins = self.inputs
        if st.first_snapshot:  # 2
            io.tx.append_encoded(self.backing, [st.snap])
            io.point(pid, "snapshot")
        io.tx.set_positions([(s, pid, e) for s, e in zip(ins, st.ends)])  # 4
        io.point(pid, "read")
        if st.first_alts:  # 4a
            assert st.order is not None
            io.tx.append_encoded(self.backing, [encode(alts_record([ins[i] for i in st.order]))])
            io.point(pid, "alts-snapshot")

    def compute(self, st: _Step) -> None:
        """Step 5, then the in-memory state: advanced, or stopped with a retry pending."""
        try:
            st.outs, st.errs, st.nsets = self._run(st.rows, st.order, st.h, True)
        except _Unhandled as u:
            st.unhandled = u
            ins = self.inputs
            self.skip_snapshot = True  # until this step is delivered: no new snapshot
            self.have_alts = self.alts
            self.retry = Recovery("retry", retry=True, starts=dict(zip(ins, st.starts)),
                                  ends=dict(zip(ins, st.ends)),
                                  order=None if st.order is None else tuple(ins[i] for i in st.order))
            self._fail(u)
            return
        self.skip_snapshot = False
        self.have_alts = False
        self.retry = None
        self.positions = st.ends
        self._pend[0] += sum(len(r) for r in st.rows)
        self._pend[3] += 1

    def write_post(self, io: _IO, st: _Step) -> None:
        """Steps 7 and 8 (or 9: the processor stops, the step stays to retry)."""
        pid = self.id
        if st.unhandled is not None:  # 9
            io.tx.set_positions([(s, pid, x) for s, x in zip(self.inputs, st.starts)])
            return
        io.point(pid, "function")
        outs, errs = st.outs, st.errs
        err_stream = self.err_stream
        h = st.h
        if outs or errs[0]:
            # 7b-7d: the attempt record names the provisional index of the last message.
            last = None
            for s in self.p.outputs:
                if s in outs:
                    last = (s, io.tx.next_index(s) + len(outs[s][0]) - 1)
            if last is not None:
                rec = attempt_record(ATTEMPT_OUTPUT, h, *last)
            else:
                assert err_stream is not None
                rec = attempt_record(ATTEMPT_ERROR, h, err_stream,
                                     io.tx.next_index(err_stream) + len(errs[0]) - 1)
            io.tx.append_encoded(self.backing, [encode(rec)])
            io.point(pid, "attempt")
            for s, (datas, metas) in outs.items():  # 7e
                io.tx.append_encoded(s, datas, metas)  # type: ignore[arg-type]
                self._pend[1] += len(datas)
            if errs[0]:
                assert err_stream is not None
                io.tx.append_encoded(err_stream, errs[0], errs[1])  # type: ignore[arg-type]
                self._pend[2] += len(errs[0])
            io.point(pid, "output")
        else:  # 8
            io.tx.append_encoded(self.backing, [encode(attempt_record(ATTEMPT_NIL, h))])
            io.point(pid, "nil")

    def step(self, io: _IO, limit: int) -> int:
        """One whole step in the seed's order (side effects, or commit="each-write")."""
        st = self.plan(self.store, limit)
        if st is None:
            return 0
        self.write_pre(io, st)
        if self.p.side_effects:
            io.durable(self.id, "before-function")
        self.compute(st)
        self.write_post(io, st)
        return st.nsets

    def _fail(self, u: _Unhandled) -> None:
        self.failed = u.line
        self.detail = u.detail
        # (extra: a caller that reports the stop itself -- `pipeline run` -- leaves it out.)
        log.error("processor %s stopped: %s (the graph has no error stream; the input is kept "
                  "and retried after a restart)", self.id, self.failed,
                  extra={"processor_stopped": self.id})
        log.info("%s: the function's traceback:\n%s", self.id, u.detail)

    # -- step 5: running the function ---------------------------------------------------

    def _run(
        self, rows: list[list[Any]], order: list[int] | None, h: bytes | None, with_hash: bool
    ) -> tuple[dict[str, tuple[list[bytes], list[bytes]]], tuple[list[bytes], list[bytes]], int]:
        """Call the function on every message set; returns outputs per stream, error
        records, and the number of message sets."""
        p = self.p
        ins = self.inputs
        kind = p.kind
        fn = p.fn
        suffix = self.meta.suffix(h if with_hash else None)
        outs: dict[str, tuple[list[bytes], list[bytes]]] = {}
        err_d: list[bytes] = []
        err_m: list[bytes] = []
        messages = p.messages
        if order is not None:
            # alts: message set j is the next row of input order[j]
            cursors = [0] * len(ins)
            sets: list[Any] = []
            for i in order:
                sets.append((i, rows[i][cursors[i]]))
                cursors[i] += 1
        else:
            sets = list(zip(*rows)) if len(rows) > 1 else rows[0]

        single_out = p.outputs[0] if len(p.outputs) == 1 and kind != "processor" else None
        if not messages and kind in ("map", "join", "alts", "fork"):
            # Fast paths: values in, values out (the common case; same results as below).
            datas: list[bytes] = []
            metas: list[bytes] = []
            err = self._error
            if kind == "fork":
                if fn is None:  # copy: the bytes go through undecoded
                    pre = self.prefix[ins[0]]
                    metas = [pre + enc_int(row[0]) + suffix for row in sets]
                    datas = [row[2] for row in sets]
                    return {s: (datas, metas) for s in p.outputs}, (err_d, err_m), len(sets)
                pre = self.prefix[ins[0]]
                outputs = p.outputs
                for row in sets:
                    try:
                        v = decode(row[2])
                        res = _fork_results(fn(v), outputs)
                        enc = [(s, row[2] if x is v else _encode(x)) for s, x in res]
                    except Exception as e:
                        err(e, [(ins[0], row)], suffix, err_d, err_m)
                        continue
                    m = pre + enc_int(row[0]) + suffix
                    for s, data in enc:
                        o = outs.get(s)
                        if o is None:
                            o = outs[s] = ([], [])
                        o[0].append(data)
                        o[1].append(m)
                return outs, (err_d, err_m), len(sets)
            assert single_out is not None
            if order is not None:  # alts: (input number, row) in order
                prefix = [self.prefix[s] for s in ins]
                for i, row in sets:
                    if fn is None:
                        out = row[2]
                    else:
                        try:
                            v = decode(row[2])
                            r = fn(v)
                            if r is None:
                                continue
                            out = row[2] if r is v else _encode(r)
                        except Exception as e:
                            err(e, [(ins[i], row)], suffix, err_d, err_m)
                            continue
                    datas.append(out)
                    metas.append(prefix[i] + enc_int(row[0]) + suffix)
            elif len(ins) == 1:  # map
                assert fn is not None
                pre = self.prefix[ins[0]]
                for row in sets:
                    data = row[2]
                    try:
                        v = decode(data)
                        r = fn(v)
                        if r is None:
                            continue
                        out = data if r is v else _encode(r)
                    except Exception as e:
                        err(e, [(ins[0], row)], suffix, err_d, err_m)
                        continue
                    datas.append(out)
                    metas.append(pre + enc_int(row[0]) + suffix)
            else:  # join
                assert fn is not None
                encode_all = self.meta.encode_all
                head, keys, order_ix = self.meta.parts()
                two = len(ins) == 2
                if two:
                    k0, k1 = keys
                    o0, o1 = order_ix
                    for item in sets:
                        a, b = item
                        try:
                            va = decode(a[2])
                            vb = decode(b[2])
                            r = fn(va, vb)
                            if r is None:
                                continue
                            out = a[2] if r is va else b[2] if r is vb else _encode(r)
                        except Exception as e:
                            err(e, list(zip(ins, item)), suffix, err_d, err_m)
                            continue
                        datas.append(out)
                        metas.append(b"".join((head, k0, enc_int(item[o0][0]), k1,
                                               enc_int(item[o1][0]), suffix)))
                else:
                    for item in sets:
                        try:
                            vals = [decode(r[2]) for r in item]
                            r = fn(*vals)
                            if r is None:
                                continue
                            out = next((x[2] for x, v in zip(item, vals) if v is r), None)
                            if out is None:
                                out = _encode(r)
                        except Exception as e:
                            err(e, list(zip(ins, item)), suffix, err_d, err_m)
                            continue
                        datas.append(out)
                        metas.append(encode_all([x[0] for x in item], suffix))
            if datas:
                outs[single_out] = (datas, metas)
            return outs, (err_d, err_m), len(sets)

        batch_values: list[Any] = []
        batch_rows: list[list[tuple[str, Any]]] = []
        for j, item in enumerate(sets):
            if order is not None:
                i, row = item
                srcs = [(ins[i], row)]
                meta_bytes = self.prefix[ins[i]] + enc_int(row[0]) + suffix
            elif len(ins) == 1:
                row = item
                srcs = [(ins[0], row)]
                meta_bytes = self.prefix[ins[0]] + enc_int(row[0]) + suffix
            else:
                srcs = list(zip(ins, item))
                meta_bytes = self.meta.encode_all([r[0] for r in item], suffix)
            try:
                if messages:
                    args = [Message(s, r[0], r[2], 0, r[3], decode(r[2])) for s, r in srcs]
                    vals = [m.value for m in args]
                else:
                    vals = [decode(r[2]) for _s, r in srcs]
                    args = vals
                results: list[tuple[str, Any]]
                if kind == "sink":
                    if p.batch:
                        batch_values.append(args[0] if len(args) == 1 else tuple(args))
                        batch_rows.append(srcs)
                        continue
                    assert fn is not None
                    fn(*args, self._delivery(h, j, srcs))
                    results = []
                elif kind == "processor":
                    assert fn is not None
                    ctx = Context(p.outputs)
                    ctx.delivery = self._delivery(h, j, srcs)
                    ctx.messages = tuple(args) if messages else ()
                    fn(ctx, *args)
                    results = ctx._out
                elif kind == "fork":
                    if fn is None:
                        results = [(s, vals[0]) for s in p.outputs]
                    else:
                        results = _fork_results(fn(*args), p.outputs)
                else:  # join, alts (and map with messages=True)
                    r = args[0] if fn is None else fn(*args)
                    if isinstance(r, Message):
                        r = r.value
                    results = [] if r is None else [(single_out, r)]  # type: ignore[list-item]
                encoded = []
                for s, v in results:
                    same = next((r for (_s, r), x in zip(srcs, vals) if x is v), None)
                    encoded.append((s, same[2] if same is not None else _encode(v)))
            except Exception as e:
                self._error(e, srcs, suffix, err_d, err_m)
                continue
            for s, data in encoded:
                o = outs.get(s)
                if o is None:
                    o = outs[s] = ([], [])
                o[0].append(data)
                o[1].append(meta_bytes)
        if batch_rows:
            assert fn is not None
            try:
                fn(batch_values, Delivery(h or b"", self.id, 0, {}))
            except Exception as e:
                for srcs in batch_rows:
                    self._error(e, srcs, suffix, err_d, err_m)
        return outs, (err_d, err_m), len(sets)

    def _delivery(self, h: bytes | None, j: int, srcs: list[tuple[str, Any]]) -> Delivery:
        return Delivery(h or b"", self.id, j, {s: r[0] for s, r in srcs})

    def _error(self, e: Exception, srcs: list[tuple[str, Any]], suffix: bytes,
               err_d: list[bytes], err_m: list[bytes]) -> None:
        positions = {s: r[0] for s, r in srcs}
        line, detail = describe_failure(self.p.kind, self.p.name, positions, e, self.p.fn)
        if self.err_stream is None:
            raise _Unhandled(e, positions, line, detail)
        log.info("%s -> error stream", line)
        inputs = []
        for _s, r in srcs:
            try:
                inputs.append(decode(r[2]))
            except ValueError:
                inputs.append(r[2])
        err = Record(_ERROR, [self.id, type(e).__name__, str(e), Sequence(inputs), detail])
        err_d.append(encode(err))
        if len(srcs) == 1:
            err_m.append(self.prefix[srcs[0][0]] + enc_int(srcs[0][1][0]) + suffix)
        else:
            err_m.append(self.meta.encode_all([r[0] for _s, r in srcs], suffix))

    # -- at-most-once ------------------------------------------------------------------

    def amo_flush(self, tx: Transaction) -> None:
        self._begin()
        pending, self.amo_pending = self.amo_pending, []
        for outs, errs in pending:
            for s, (datas, metas) in outs.items():
                tx.append_encoded(s, datas, metas)  # type: ignore[arg-type]
                self._pend[1] += len(datas)
            if errs[0]:
                assert self.err_stream is not None
                tx.append_encoded(self.err_stream, errs[0], errs[1])  # type: ignore[arg-type]
                self._pend[2] += len(errs[0])

    def amo_read(self, tx: Transaction, limit: int) -> int:
        self._begin()
        got = self._read(tx, limit)
        if got is None:
            return 0
        starts, ends, rows, order = got
        tx.set_positions([(s, self.id, e) for s, e in zip(self.inputs, ends)])
        self.positions = ends
        self.amo_batches.append((starts, ends, rows, order))
        self._pend[0] += sum(len(r) for r in rows)
        self._pend[3] += 1
        return max(len(r) for r in rows) if order is None else len(order)

    def amo_compute(self) -> None:
        batches, self.amo_batches = self.amo_batches, []
        for starts, ends, rows, order in batches:
            if self.failed:
                return  # at-most-once: batches read after a failure are not processed
            h = None
            if self.p.side_effects or self.p.kind == "processor":
                h = delivery_hash(self.id, dict(zip(self.inputs, starts)), dict(zip(self.inputs, ends)))
            try:
                outs, errs, _n = self._run(rows, order, h, False)
            except _Unhandled as u:
                self._fail(u)  # at-most-once: the batch is not retried
                return
            if outs or errs[0]:
                self.amo_pending.append((outs, errs))

    # -- statistics --------------------------------------------------------------------

    def stats(self, nexts: dict[str, int]) -> ProcStats:
        lag = {s: max(0, nexts.get(s, 0) - self.positions[i]) for i, s in enumerate(self.inputs)}
        if self.failed:
            state = "failed"
        elif self.has_input(nexts):
            state = "running"
        elif any(lag.values()):
            state = "waiting"  # a join waiting for its other inputs
        else:
            state = "idle"
        return ProcStats(self.p.name, self.p.kind, self.consumed, self.produced, self.errors,
                         self.steps, lag, state, self.failed, self.recovery, detail=self.detail)


def _encode(v: Any) -> bytes:
    """Encode an output value, refusing one over the entry size limit (an error of the
    function, like a value that is not a Preserves value)."""
    return encode_value(v, "the output")


def _merge_order(rows: list[list[Any]]) -> list[int]:
    """The alts order of a retry without a recorded order: commit order (seq)."""
    merged = sorted((row[1], i) for i, r in enumerate(rows) for row in r)
    return [i for _seq, i in merged]


def _fork_results(r: Any, outputs: tuple[str, ...]) -> list[tuple[str, Any]]:
    if r is None:
        return []
    if isinstance(r, dict):
        out = []
        for s, v in r.items():
            if s not in outputs:
                raise KeyError(f"fork returned output {s!r}, not one of {', '.join(outputs)}")
            if v is None:
                continue
            if isinstance(v, list):
                out += [(s, x) for x in v]
            else:
                out.append((s, v))
        return out
    if isinstance(r, (tuple, list)) and not isinstance(r, Sequence) and len(r) == len(outputs):
        return [(s, v) for s, v in zip(outputs, r) if v is not None]
    raise TypeError(
        f"a fork function returns {{output: value}} or one value per output "
        f"({len(outputs)}), not {type(r).__name__}"
    )


class LocalEngine(Engine):
    """Runs a graph in this process (see the module docstring).

    Options: ``guarantee`` (``"exactly-once"`` or ``"at-most-once"``), ``batch`` (max
    message sets per step, default 1000), ``commit`` (``"group"`` or ``"each-write"``),
    ``group_ms`` (longest time one group transaction stays open, default 50 ms),
    ``fault`` (``fault(processor_id, point)``, called at every point of
    :data:`POINTS` -- raise :class:`Crash` there to inject a failure), ``backing_keep``
    (records kept per backing stream, default 1000).
    """

    name = "local"

    def __init__(
        self,
        graph: Graph,
        store: Store,
        *,
        guarantee: str = "exactly-once",
        batch: int = 1000,
        commit: str = "group",
        group_ms: float = 50.0,
        fault: Callable[[str, str], None] | None = None,
        backing_keep: int = 1000,
    ) -> None:
        super().__init__(graph, store)
        spark_only = [p.name for p in graph.processors.values() if p.kind == "dataframe"]
        if spark_only:
            raise EngineError(
                f"{', '.join(spark_only)}: DataFrame processors run on Spark only; run the "
                "graph with --engine spark (the default)"
            )
        if guarantee not in GUARANTEES:
            raise EngineError(f"guarantee must be one of {', '.join(GUARANTEES)}, not {guarantee!r}")
        if commit not in ("group", "each-write"):
            raise EngineError("commit must be 'group' or 'each-write'")
        if batch < 1:
            raise EngineError("batch must be >= 1")
        self.guarantee = guarantee
        self.batch = batch
        self.each_write = commit == "each-write"
        self.group_ms = group_ms
        self.fault = fault
        self.backing_keep = max(backing_keep, 8)
        self.procs = [_Proc(graph, p, store) for p in graph.order()]
        self.pure = [q for q in self.procs if not q.p.side_effects]
        self.effectful = [q for q in self.procs if q.p.side_effects]
        self.started = False
        self._lock: StoreLock | None = None
        self.commits = 0
        self._amo_k = 1

    # -- start: claim the graph, recover every processor ---------------------------------

    def _claim(self) -> None:
        self._lock = claim_graph(self.store, self.graph.name, self.name)

    def start(self) -> None:
        if self.started:
            return
        check_sources(self.graph, self.store)  # before anything is claimed or created
        self._claim()
        try:
            self._recover()
        except BaseException:
            self.close()
            raise
        self.started = True

    def _recover(self) -> None:
        g = self.graph
        with self.store.transaction() as tx:
            for s in g.streams():
                tx.create_stream(s)
            for q in self.procs:
                tx.create_stream(q.backing)
                tx.set_retention(q.backing, self.backing_keep, None)
                rec = recover(tx, q.id)
                q.recovery = rec.branch if self.guarantee == "exactly-once" else "at-most-once"
                saved = {s: tx.position(s, q.id) for s in q.inputs}

                def fresh(s: str, tx: Transaction = tx) -> int:
                    first = tx.first_index(s)
                    return first if first is not None else tx.next_index(s)

                r = resume(rec, saved, fresh, q.inputs, self.guarantee)
                if self.guarantee != "exactly-once" and close_interrupted(tx, q.id, rec):
                    log.warning("%s: an interrupted exactly-once step (%s to %s) is closed "
                                "unretried: at-most-once skips its messages", q.id,
                                rec.starts, rec.ends)
                if r.note is not None:
                    log.warning("%s: %s", q.id, r.note)
                    q.recovery = f"{rec.branch} (superseded)"
                if r.retry:
                    # 1b / 1c / 3b: reset the tailers to the snapshot; no new snapshot
                    # until this delivery succeeds.
                    q.retry = rec
                    q.skip_snapshot = True
                    q.have_alts = rec.order is not None
                q.positions = [r.positions[s] for s in q.inputs]
                if [saved[s] for s in q.inputs] != q.positions:
                    tx.set_positions([(s, q.id, p) for s, p in zip(q.inputs, q.positions)])
                log.info("%s: recovery %s (%s); positions %s", q.id, rec.branch, rec.detail,
                         dict(zip(q.inputs, q.positions)))

    # -- running -----------------------------------------------------------------------

    def ready(self) -> list[_Proc]:
        """Processors with input to process now."""
        nexts = self.store.next_indices()
        return [q for q in self.procs if q.has_input(nexts)]

    def run_round(self) -> int:
        """One group: steps of every processor with input; returns message sets done.

        A step counts (messages in and out, errors, steps) once its transaction commits;
        when a read or a commit fails, what the round did not commit is forgotten -- the
        processors' positions are again the store's -- and the error propagates."""
        if not self.started:
            self.start()
        try:
            return self._round_amo() if self.guarantee == "at-most-once" else self._round()
        except BaseException:
            for q in self.procs:
                q.settle(False)
            raise

    def _round(self) -> int:
        nexts = self.store.next_indices()
        todo = [q for q in self.procs if q.has_input(nexts)]
        if not todo:
            return 0
        done = 0
        store = self.store
        if self.each_write:
            for q in self.procs:
                if q.failed or not q.has_input(store.next_indices()):
                    continue
                io = _IO(store, True, self.fault)
                try:
                    done += q.step(io, self.batch)
                    io.commit()
                    self.commits += 1
                except BaseException:
                    io.rollback()
                    raise
                q.settle(True)
            return done
        if any(not q.p.side_effects for q in todo):
            # Plan and compute steps (no lock held) for about group_ms, then write them
            # all in one transaction.
            steps: list[tuple[_Proc, _Step]] = []
            deadline = time.monotonic() + self.group_ms / 1000.0
            while True:
                progress = 0
                for q in self.pure:
                    if q.failed:
                        continue
                    st = q.plan(store, self.batch)
                    if st is None:
                        continue
                    q.compute(st)
                    steps.append((q, st))
                    progress += st.nsets or 1
                done += progress
                if not progress or time.monotonic() >= deadline:
                    break
            if steps:
                io = _IO(store, False, self.fault)
                try:
                    for q, st in steps:
                        q.write_pre(io, st)
                        q.write_post(io, st)
                    io.commit()
                    self.commits += 1
                except BaseException:
                    io.rollback()
                    raise
                for q, _st in steps:
                    q.settle(True)
        nexts = store.next_indices() if self.effectful else nexts
        for q in self.effectful:
            if q.failed or not q.has_input(nexts):
                continue
            io = _IO(store, False, self.fault)
            try:
                done += q.step(io, self.batch)
                io.commit()
                self.commits += 1
            except BaseException:
                io.rollback()
                raise
            q.settle(True)
        return done

    def _round_amo(self) -> int:
        # The same group commit as exactly-once: as many batches per processor per group
        # as take about group_ms to compute (adapted after every group).
        nexts = self.store.next_indices()
        pending = any(q.amo_pending for q in self.procs)
        if not pending and not any(q.has_input(nexts) for q in self.procs):
            return 0
        done = 0
        io = _IO(self.store, False, self.fault)
        try:
            for q in self.procs:
                q.amo_flush(io.tx)
                if not q.failed:
                    for _ in range(self._amo_k):
                        n = q.amo_read(io.tx, self.batch)
                        done += n
                        if n < self.batch:
                            break
            io.commit()
            self.commits += 1
        except BaseException:
            io.rollback()
            raise
        for q in self.procs:
            q.settle(True)
        t = time.monotonic()
        for q in self.procs:
            q.amo_compute()
        took = (time.monotonic() - t) * 1000.0
        if took < self.group_ms / 2 and self._amo_k < 256:
            self._amo_k *= 2
        elif took > self.group_ms * 2 and self._amo_k > 1:
            self._amo_k //= 2
        return done or int(pending)

    def _flush_amo(self) -> None:
        if any(q.amo_pending for q in self.procs):
            try:
                with self.store.transaction() as tx:
                    for q in self.procs:
                        q.amo_flush(tx)
            except BaseException:
                for q in self.procs:
                    q.settle(False)
                raise
            for q in self.procs:
                q.settle(True)

    def idle(self) -> bool:
        """No processor has input (and nothing is waiting to be written)."""
        if any(q.amo_pending or q.amo_batches for q in self.procs):
            return False
        return not self.ready()

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        until_idle: bool = False,
        on_progress: Callable[[list[ProcStats]], None] | None = None,
        progress_interval: float = 1.0,
    ) -> list[ProcStats]:
        self.start()
        stop = stop or self._stop
        next_progress = time.monotonic() + progress_interval
        try:
            while not stop.is_set() and not self._stop.is_set():
                gen = self.store.generation()
                n = self.run_round()
                now = time.monotonic()
                if on_progress is not None and now >= next_progress:
                    on_progress(self.stats())
                    next_progress = now + progress_interval
                if n:
                    continue
                if all(q.failed for q in self.procs):
                    break
                if until_idle and self.idle():
                    break
                # Idle: sleep until the store changes (no polling); wake for the next
                # progress report at the latest.
                wait = 5.0
                if on_progress is not None:
                    wait = max(next_progress - time.monotonic(),
                               progress_interval if progress_interval > 0 else 1.0)
                self.store.wait_change(gen, wait)
            if self.guarantee == "at-most-once":
                self._flush_amo()
        finally:
            if on_progress is not None:
                with contextlib.suppress(Exception):
                    on_progress(self.stats())
        return self.stats()

    def drain(self) -> list[ProcStats]:
        """Process until no processor has input; returns the statistics."""
        return self.run(until_idle=True)

    def stats(self) -> list[ProcStats]:
        nexts = self.store.next_indices()
        return [q.stats(nexts) for q in self.procs]

    @property
    def failed(self) -> dict[str, str]:
        """Processors stopped by an unhandled error: name -> error."""
        return {q.p.name: q.failed for q in self.procs if q.failed}

    def recovery(self) -> dict[str, str]:
        """The recovery branch each processor took at start (seed 002 numbering)."""
        return {q.p.name: q.recovery for q in self.procs}

    def close(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            with contextlib.suppress(Exception):
                lock.release()
