"""The exactly-once algorithm of seed 002: backing-stream records, delivery hash, recovery.

This module is engine-independent: the local engine (:mod:`.local`) and the Spark engine
use the same records, the same hash and the same recovery.

Records on a processor's backing stream (``__backing/<graph>/<processor>``), Preserves
values written in canonical binary form:

``<snapshot "graph/proc" {input: start ...} {input: end ...}>``
    Step 1-2 of the persistence component: the processor id and, per input tailer, the
    index of the first message of the step (``start``) and the index after its last one
    (``end``).  A step reads one or more message sets (seed step 4 allows "one or more
    messages"); recording where it ends makes a retry read exactly the same messages and
    makes the hash identify the step -- the Spark micro-batch model: processor id + the
    batch's start and end offsets.  Written only on the first attempt of a step.
``<snapshot-alts [[input count] ...]>``
    Step 4a, alts processors only: which input each message set of the step was read from,
    in order (run-length encoded).  Written right after the read, on the first attempt.
``<attempt-output "stream" index #[hash]>`` / ``<attempt-error "stream" index #[hash]>``
    Step 7: the index of the step's last output (or error) message; written in the same
    transaction as the messages.  Recovery reads that message back and takes the delivery
    hash from its metadata (7a); the hash in the record is used only when retention has
    already removed the message (it is never used to decide a write happened).
``<attempt-nil #[hash]>``
    Step 8: the step wrote nothing; the hash is in the record.

The **delivery hash** is ``BLAKE2b-128`` of the canonical encoding of the snapshot record:
stable across processes, machines and Python versions (never Python's ``hash()``).

Output and error messages carry metadata ``{src: {input: index ...} hash: #[...]}``: the
input positions of the message set that produced them and the step's delivery hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..values import Dictionary, Record, Symbol, Value, decode, encode
from ..values import Sequence as PSequence

__all__ = [
    "ATTEMPT_ERROR",
    "ATTEMPT_NIL",
    "ATTEMPT_OUTPUT",
    "HASH_SIZE",
    "SNAPSHOT",
    "SNAPSHOT_ALTS",
    "BackingCorrupt",
    "MetaEncoder",
    "Recovery",
    "alts_record",
    "attempt_record",
    "commit_step",
    "backing_stream",
    "delivery_hash",
    "hash_of",
    "meta_hash",
    "parse_record",
    "recover",
    "Resume",
    "Staged",
    "close_interrupted",
    "resume",
    "snapshot_record",
    "source_metas",
]

HASH_SIZE = 16

SNAPSHOT = Symbol("snapshot")
SNAPSHOT_ALTS = Symbol("snapshot-alts")
ATTEMPT_OUTPUT = Symbol("attempt-output")
ATTEMPT_ERROR = Symbol("attempt-error")
ATTEMPT_NIL = Symbol("attempt-nil")
_SRC = Symbol("src")
_HASH = Symbol("hash")


class BackingCorrupt(ValueError):
    """A backing-stream record that is not one of ours (the store was tampered with)."""


def backing_stream(proc_id: str) -> str:
    """The name of a processor's backing stream."""
    return f"__backing/{proc_id}"


def snapshot_record(proc_id: str, starts: Mapping[str, int], ends: Mapping[str, int]) -> Record:
    """The snapshot record of a step (see the module docstring)."""
    return Record(SNAPSHOT, [proc_id, Dictionary(dict(starts)), Dictionary(dict(ends))])


def hash_of(encoded_snapshot: bytes) -> bytes:
    """The delivery hash of an encoded snapshot record."""
    return hashlib.blake2b(encoded_snapshot, digest_size=HASH_SIZE).digest()


def delivery_hash(proc_id: str, starts: Mapping[str, int], ends: Mapping[str, int]) -> bytes:
    """The delivery hash of the step of ``proc_id`` reading ``[starts[i], ends[i])`` of
    every input ``i``: BLAKE2b-128 of the canonical encoding of its snapshot record.

    >>> delivery_hash("g/p", {"in": 0}, {"in": 10}).hex()
    '5c40e83105d6271ab7cca632222a95d2'
    """
    return hash_of(encode(snapshot_record(proc_id, starts, ends)))


def alts_record(order: Sequence[str]) -> Record:
    """The alts snapshot of a step: the input of each message set, run-length encoded."""
    runs: list[list[Any]] = []
    for name in order:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return Record(SNAPSHOT_ALTS, [PSequence(PSequence(r) for r in runs)])


def attempt_record(kind: Symbol, hash_: bytes, stream: str | None = None, index: int | None = None) -> Record:
    """An attempt record (``ATTEMPT_OUTPUT``/``ATTEMPT_ERROR`` with stream and index, or
    ``ATTEMPT_NIL``)."""
    if kind is ATTEMPT_NIL:
        return Record(ATTEMPT_NIL, [hash_])
    return Record(kind, [stream, index, hash_])


@dataclass(frozen=True)
class Parsed:
    """A backing record, parsed."""

    kind: Symbol
    proc_id: str | None = None
    starts: dict[str, int] | None = None
    ends: dict[str, int] | None = None
    order: tuple[str, ...] | None = None
    stream: str | None = None
    index: int | None = None
    hash: bytes | None = None


def _dict(v: Value, what: str) -> dict[str, int]:
    if not isinstance(v, Dictionary):
        raise BackingCorrupt(f"{what} is not a dictionary")
    out = {}
    for k, x in v.items():
        if type(k) is not str or type(x) is not int:
            raise BackingCorrupt(f"{what} maps {k!r} to {x!r}")
        out[k] = x
    return out


def parse_record(data: bytes) -> Parsed:
    """Parse an encoded backing record (raises :class:`BackingCorrupt`)."""
    try:
        v = decode(data)
    except ValueError as e:
        raise BackingCorrupt(f"undecodable backing record: {e}") from e
    if not isinstance(v, Record) or type(v.label) is not Symbol:
        raise BackingCorrupt(f"not a backing record: {v!r}")
    f = v.fields
    label = v.label
    try:
        if label == SNAPSHOT and len(f) == 3 and type(f[0]) is str:
            return Parsed(SNAPSHOT, proc_id=f[0], starts=_dict(f[1], "snapshot starts"),
                          ends=_dict(f[2], "snapshot ends"))
        if label == SNAPSHOT_ALTS and len(f) == 1:
            order: list[str] = []
            for run in f[0]:
                name, count = run
                if type(name) is not str or type(count) is not int or count < 1:
                    raise BackingCorrupt(f"bad alts run {run!r}")
                order += [name] * count
            return Parsed(SNAPSHOT_ALTS, order=tuple(order))
        if label in (ATTEMPT_OUTPUT, ATTEMPT_ERROR) and len(f) == 3:
            if type(f[0]) is not str or type(f[1]) is not int or type(f[2]) is not bytes:
                raise BackingCorrupt(f"bad attempt record {v!r}")
            kind = ATTEMPT_OUTPUT if label == ATTEMPT_OUTPUT else ATTEMPT_ERROR
            return Parsed(kind, stream=f[0], index=f[1], hash=f[2])
        if label == ATTEMPT_NIL and len(f) == 1 and type(f[0]) is bytes:
            return Parsed(ATTEMPT_NIL, hash=f[0])
    except (TypeError, ValueError) as e:
        if isinstance(e, BackingCorrupt):
            raise
        raise BackingCorrupt(f"bad backing record {v!r}: {e}") from e
    raise BackingCorrupt(f"unknown backing record {v!r}")


def meta_hash(meta_data: bytes | None) -> bytes | None:
    """The delivery hash in a message's metadata (None if it has none)."""
    if meta_data is None:
        return None
    try:
        m = decode(meta_data)
    except ValueError:
        return None
    if isinstance(m, Dictionary):
        h = m.get(_HASH)
        if type(h) is bytes:
            return h
    return None


# -- metadata of output messages (a fast canonical encoder) ------------------------------


_INT_HDR = [bytes((0xB0, n)) for n in range(128)]
_SMALL = [b"\xb0\x00"] + [bytes((0xB0, 1, i)) for i in range(1, 128)]


def _enc_int(v: int) -> bytes:
    """The canonical encoding of an integer (indices: usually small and non-negative)."""
    if 0 <= v < 128:
        return _SMALL[v]
    n = ((v if v >= 0 else ~v).bit_length() + 8) >> 3
    return (_INT_HDR[n] if n < 128 else encode(v)[: -n]) + v.to_bytes(n, "big", signed=True)


_SRC_ENC = encode(_SRC)
_SRC_HEAD = b"\xb7" + _SRC_ENC + b"\xb7"  # {src: { -- what every metadata starts with
_HASH_ENC = encode(_HASH)


class MetaEncoder:
    """Builds ``{src: {input: index ...} hash: #[...]}`` for a processor's messages.

    The output equals ``encode()`` of that dictionary (canonical: keys in the order of
    their encodings) and is built by concatenation, because every output message gets one.
    """

    def __init__(self, inputs: Sequence[str]) -> None:
        self.inputs = tuple(inputs)
        keyed = sorted((encode(name), i) for i, name in enumerate(self.inputs))
        self.key_enc = {self.inputs[i]: kb for kb, i in keyed}
        self.order = [i for _kb, i in keyed]
        # _SRC_ENC sorts before _HASH_ENC (shorter length byte), checked here once.
        assert _SRC_ENC < _HASH_ENC

    def suffix(self, hash_: bytes | None) -> bytes:
        """The bytes after the positions: closes ``src`` and adds the hash."""
        if hash_ is None:
            return b"\x84\x84"
        return b"\x84" + _HASH_ENC + bytes((0xB2, len(hash_))) + hash_ + b"\x84"

    def prefix_one(self, name: str) -> bytes:
        """Everything before the index when only input ``name`` is listed (alts, map)."""
        return _SRC_HEAD + self.key_enc[name]

    def parts(self) -> tuple[bytes, list[bytes], list[int]]:
        """(head, key encodings in canonical order, input number of each key): the
        pieces :meth:`encode_all` concatenates, for callers with their own loop."""
        return (_SRC_HEAD, [self.key_enc[self.inputs[i]] for i in self.order],
                list(self.order))

    def encode_all(self, positions: Sequence[int], suffix: bytes) -> bytes:
        """Metadata listing every input, ``positions`` aligned with the inputs."""
        parts = [b"\xb7", _SRC_ENC, b"\xb7"]
        key_enc = self.key_enc
        inputs = self.inputs
        for i in self.order:
            parts.append(key_enc[inputs[i]])
            parts.append(_enc_int(positions[i]))
        parts.append(suffix)
        return b"".join(parts)


enc_int = _enc_int


def source_metas(srcs: Sequence[Mapping[str, int]], suffix: bytes) -> list[bytes]:
    """Metadata of messages with at most one source position each (``{}`` or
    ``{input: index}``), ended by ``suffix`` (:meth:`MetaEncoder.suffix`)."""
    no_src = _SRC_HEAD + suffix
    keys: dict[str, bytes] = {}
    out = []
    for src in srcs:
        if not src:
            out.append(no_src)
            continue
        if len(src) > 1:
            raise ValueError("source_metas: a message with several source positions")
        (name, idx), = src.items()
        k = keys.get(name)
        if k is None:
            k = keys[name] = _SRC_HEAD + encode(name)  # MetaEncoder.prefix_one's bytes
        out.append(k + _enc_int(idx) + suffix)
    return out


# -- recovery ----------------------------------------------------------------------------


class Reader(Protocol):
    """What recovery needs from the store (a transaction or a store)."""

    def last(self, stream: str, before: int | None = None, limit: int = 1) -> list[Any]: ...

    def get(self, stream: str, index: int) -> Any: ...

    def first_index(self, stream: str) -> int | None: ...


@dataclass
class Recovery:
    """The outcome of the recovery component for one processor.

    ``branch`` names the seed's branches taken, e.g. ``"1a"`` (never ran), ``"1b"``
    (snapshot: retry), ``"1c+1b"`` (alts snapshot: retry reading the same inputs),
    ``"1d+3a"`` (last output delivered), ``"1e+3b"`` (the last error write failed: retry),
    ``"1f+3a"`` (last step wrote nothing, delivered).  ``retry`` is true when the last step
    must be retried: the tailers go back to ``starts``, the step reads up to ``ends``, no
    new snapshot is written and, for alts, ``order`` (if recorded) is followed.  Otherwise
    processing continues from ``ends`` (or, when the processor never ran, from the
    tailers' saved positions).
    """

    branch: str
    retry: bool = False
    starts: dict[str, int] | None = None
    ends: dict[str, int] | None = None
    order: tuple[str, ...] | None = None
    delivered_hash: bytes | None = None
    detail: str = ""


@dataclass(frozen=True)
class Resume:
    """Where an exactly-once run of a processor starts (see :func:`resume`)."""

    positions: dict[str, int]
    """Per input, the index its tailer starts at."""
    retry: bool
    """The interrupted step of the backing stream is retried (``positions`` are its
    starts; it reads up to its ends, with the same delivery hash)."""
    note: str | None = None
    """Why the positions are not those of the backing stream's last step, if they are not."""


def resume(
    rec: Recovery,
    saved: Mapping[str, int | None],
    fresh: Callable[[str], int],
    inputs: Sequence[str],
    guarantee: str = "exactly-once",
) -> Resume:
    """Where a run of a processor starts, from the recovery component's outcome ``rec``
    and the tailers' saved positions (``fresh(input)``: where a tailer never saved starts).

    One rule for every engine and guarantee.  A run without exactly-once (at-most-once
    keeps no backing records: it moves the tailers and nothing else) may have consumed
    messages after the last step the backing stream knows of.  They were delivered at
    most once already and must not be delivered again.  So an exactly-once run:

    * after a delivered step (3a) goes on from the step's end, or from the saved position
      where that is further on;
    * retries an interrupted step (1b/1c/3b) while the tailers are at its start or its
      end (step 4 of the seed moves them to the end before the function runs); if a run
      moved them beyond its end, that run consumed those messages: the step is not
      retried, and each input goes on from its saved position;
    * starts a processor that never ran (1a) at its saved positions, else fresh.

    An at-most-once run starts at the saved positions, but never inside an interrupted
    exactly-once step (whose function may already have had its effects): it starts after
    it, and closes it first (:func:`close_interrupted`), so no later exactly-once run
    retries it either -- its messages are skipped, which at-most-once allows; they are
    never delivered twice.  A saved position *behind* the backing stream's record is not
    followed (going back would deliver twice).
    """
    sv = {s: saved.get(s) for s in inputs}
    if guarantee != "exactly-once":
        pos = {s: sv[s] if sv[s] is not None else fresh(s) for s in inputs}
        if rec.retry and rec.ends is not None:
            pos = {s: max(p, rec.ends.get(s, p)) for s, p in pos.items()}
        return Resume(pos, False)
    if rec.retry and rec.starts is not None and rec.ends is not None:
        ends = rec.ends
        moved = [s for s in inputs if sv[s] is not None and sv[s] > ends.get(s, sv[s])]  # type: ignore[operator]
        if not moved:
            return Resume({s: rec.starts[s] for s in inputs}, True)
        pos = {s: max(sv[s] or 0, ends.get(s, 0)) for s in inputs}
        return Resume(pos, False, (
            "a run without exactly-once moved the tailers past the interrupted step "
            f"({', '.join(moved)}), so it is not retried: going on from the tailers"))
    if rec.ends is not None:
        pos: dict[str, int] = {}
        ahead = []
        for s in inputs:
            e = rec.ends.get(s)
            p = sv[s]
            if e is None:  # an input the step did not have
                pos[s] = p if p is not None else fresh(s)
            elif p is not None and p > e:
                pos[s] = p
                ahead.append(s)
            else:
                pos[s] = e
        note = None
        if ahead:
            note = ("a run without exactly-once moved the tailers past the last delivered "
                    f"step ({', '.join(ahead)}): going on from the tailers")
        return Resume(pos, False, note)
    return Resume({s: sv[s] if sv[s] is not None else fresh(s) for s in inputs}, False)


def close_interrupted(tx: Any, proc_id: str, rec: Recovery) -> bool:
    """Mark an interrupted step (``rec.retry``) as done, with an ``attempt-nil`` record of
    its delivery hash, so that recovery reports it delivered (1f+3a) from now on.  For an
    at-most-once run taking over a processor (see :func:`resume`).  True if written."""
    if not rec.retry or rec.starts is None or rec.ends is None:
        return False
    h = delivery_hash(proc_id, rec.starts, rec.ends)
    tx.append_encoded(backing_stream(proc_id), [encode(attempt_record(ATTEMPT_NIL, h))])
    return True


def recover(reader: Reader, proc_id: str, chunk: int = 64) -> Recovery:
    """Run the recovery component (seed 002) for ``proc_id``; idempotent, read-only."""
    stream = backing_stream(proc_id)
    recs = reader.last(stream, None, chunk)
    if not recs:
        return Recovery("1a", detail="no backing record: the processor never made an attempt")
    newest = parse_record(recs[0].data)
    order: tuple[str, ...] | None = None
    # 1b / 1c: the previous attempt failed before delivering.
    if newest.kind in (SNAPSHOT, SNAPSHOT_ALTS):
        snap, _ = _find_snapshot(reader, stream, recs, proc_id)
        if newest.kind is SNAPSHOT_ALTS:
            order = newest.order
            branch = "1c+1b"
        else:
            branch = "1b"
        return Recovery(branch, retry=True, starts=snap.starts, ends=snap.ends, order=order,
                        detail="the last attempt did not deliver: retry it")
    # 1d / 1e / 1f: find the delivery hash of the last attempt.
    if newest.kind is ATTEMPT_NIL:
        branch = "1f"
        h = newest.hash
    else:
        branch = "1d" if newest.kind is ATTEMPT_OUTPUT else "1e"
        assert newest.stream is not None and newest.index is not None
        msg = reader.get(newest.stream, newest.index)
        if msg is not None:
            h = meta_hash(msg.meta_data)
        else:
            first = reader.first_index(newest.stream)
            if first is not None and newest.index < first:
                h = newest.hash  # written, then removed by retention
            else:
                h = None  # never written: the attempt failed
    # 2: the most recent snapshot and its hash.
    snap, snap_data = _find_snapshot(reader, stream, recs, proc_id)
    # The alts order recorded after that snapshot, for a retry.
    for r in recs[1:]:
        p = parse_record(r.data)
        if p.kind is SNAPSHOT:
            break
        if p.kind is SNAPSHOT_ALTS:
            order = p.order
    if h is not None and h == hash_of(snap_data):
        return Recovery(branch + "+3a", starts=snap.starts, ends=snap.ends, delivered_hash=h,
                        detail="the last attempt delivered")
    return Recovery(branch + "+3b", retry=True, starts=snap.starts, ends=snap.ends, order=order,
                    detail="the last attempt record has no matching delivered message: retry")


def _find_snapshot(reader: Reader, stream: str, recs: list[Any], proc_id: str) -> tuple[Parsed, bytes]:
    """Read backwards from the newest record to the most recent snapshot."""
    while True:
        for r in recs:
            p = parse_record(r.data)
            if p.kind is SNAPSHOT:
                if p.proc_id != proc_id:
                    raise BackingCorrupt(
                        f"the backing stream of {proc_id} holds a snapshot of {p.proc_id}"
                    )
                return p, r.data
        before = recs[-1].index
        recs = reader.last(stream, before, 256)
        if not recs:
            raise BackingCorrupt(
                f"the backing stream of {proc_id} has attempt records but no snapshot "
                "(was it trimmed by hand?)"
            )


# -- a whole step in one transaction (for engines that compute elsewhere: Spark) -----------


@dataclass(frozen=True)
class Staged:
    """Outputs written ahead with :meth:`Store.stage` (by Spark's tasks): per part, its
    token, how many rows, and the delivery hash their metadata ends with (None: the
    unhashed form).  Its length is the number of rows."""

    parts: tuple[tuple[str, int, bytes | None], ...]

    def __len__(self) -> int:
        return sum(n for _t, n, _h in self.parts)


def _append_staged(tx: Any, stream: str, staged: Staged, h: bytes, suffix: bytes) -> None:
    """Append ``staged`` to ``stream`` with this step's hash ``h`` in every metadata
    (rewritten inside the store where a part's differs)."""
    run: list[tuple[str, int]] = []
    cut = 0
    for token, n, hh in staged.parts:
        c = 0 if hh == h else len(MetaEncoder(()).suffix(hh))
        if run and c != cut:
            tx.append_staged(stream, run, meta_cut=cut, meta_suffix=suffix if cut else b"")
            run = []
        run.append((token, n))
        cut = c
    if run:
        tx.append_staged(stream, run, meta_cut=cut, meta_suffix=suffix if cut else b"")


def commit_step(
    tx: Any,
    proc_id: str,
    starts: Mapping[str, int],
    ends: Mapping[str, int],
    outputs: Mapping[str, Sequence[tuple[bytes, Mapping[str, int] | bytes]] | Staged],
    *,
    errors: Sequence[tuple[bytes, Mapping[str, int] | bytes]] | Staged = (),
    error_stream: str | None = None,
    order: Sequence[str] | None = None,
    hashed: bool = False,
) -> bool:
    """Write one step of ``proc_id`` -- inputs ``[starts, ends)``, already computed -- in
    the transaction ``tx``, as the persistence component does; returns False and writes
    nothing when recovery finds this very step already delivered.

    ``outputs`` maps each output stream to ``(encoded value, input positions)`` pairs
    (positions may be empty -- an output of an aggregation has no single source -- or
    already encoded metadata without a hash, as :meth:`MetaEncoder.suffix` ``(None)``
    ends it: the step's hash is spliced in);
    ``errors`` are encoded error records for ``error_stream``; ``order`` is an alts step's
    input per message set; ``hashed``: the encoded metadata ends with this step's hash
    already (whoever made it knew the step) and is written as it is.  Outputs and errors
    may be :class:`Staged` instead: rows the store holds aside, appended inside it.  The snapshot is written unless it is the pending retry's, the
    tailers (named ``proc_id``) move to ``ends``, and the attempt record and the messages
    (with ``{src, hash}`` metadata) follow.  This is the commit of a Spark micro-batch:
    a re-commit of the same batch after a crash between our commit and Spark's commit log
    writes nothing."""
    starts, ends = dict(starts), dict(ends)
    rec = recover(tx, proc_id)
    if not rec.retry and rec.starts == starts and rec.ends == ends:
        return False  # 3a for this very step: delivered already
    snap = encode(snapshot_record(proc_id, starts, ends))
    h = hash_of(snap)
    backing = backing_stream(proc_id)
    retrying = rec.retry and rec.starts == starts and rec.ends == ends
    if not retrying:
        tx.append_encoded(backing, [snap])
    tx.set_positions([(s, proc_id, e) for s, e in ends.items()])
    if order is not None and not (retrying and rec.order is not None):
        tx.append_encoded(backing, [encode(alts_record(order))])
    names = sorted(set(starts))
    meta = MetaEncoder(names)
    suffix = meta.suffix(h)

    no_src = _SRC_HEAD + suffix

    def metas(items: Sequence[tuple[bytes, Mapping[str, int] | bytes]]) -> list[bytes]:
        out = []
        for _data, src in items:
            if type(src) is bytes:  # encoded already, without a hash: add this step's
                out.append(src if hashed else src[:-2] + suffix)
            elif not src:
                out.append(no_src)
            elif len(src) == 1:
                (name, idx), = src.items()  # type: ignore[union-attr]
                out.append(meta.prefix_one(name) + enc_int(idx) + suffix)
            else:
                out.append(meta.encode_all([src[n] for n in names], suffix))  # type: ignore[index]
        return out

    written = {s: items for s, items in outputs.items() if items}
    if written:
        s = list(written)[-1]
        rec_v = attempt_record(ATTEMPT_OUTPUT, h, s, tx.next_index(s) + len(written[s]) - 1)
    elif errors:
        if error_stream is None:
            raise ValueError("errors given without an error stream")
        rec_v = attempt_record(ATTEMPT_ERROR, h, error_stream,
                               tx.next_index(error_stream) + len(errors) - 1)
    else:
        rec_v = attempt_record(ATTEMPT_NIL, h)
    tx.append_encoded(backing, [encode(rec_v)])
    for s, items in written.items():
        if isinstance(items, Staged):
            _append_staged(tx, s, items, h, suffix)
        else:
            tx.append_encoded(s, [d for d, _src in items], metas(items))
    if errors:
        assert error_stream is not None
        if isinstance(errors, Staged):
            _append_staged(tx, error_stream, errors, h, suffix)
        else:
            tx.append_encoded(error_stream, [d for d, _src in errors], metas(errors))
    return True
