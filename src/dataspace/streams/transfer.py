"""Streams to and from files: ``dataspace stream export`` and ``dataspace stream import``.

**The export format** keeps each entry's index (and metadata), in Preserves text or binary:

* text (the default): one value per line, UTF-8 -- first a header, then one record per
  entry, ``<entry INDEX VALUE>``, or ``<entry INDEX VALUE META>`` when the entry has
  metadata::

      <dataspace-stream-export 1 {stream: "chat"}>
      <entry 0 <Says "alice" "hi">>
      <entry 1 <Says "bob" "yo">>

* binary: the same values as a sequence of canonical binary encodings, one after the
  other (no separators, no lengths: each encoding delimits itself).

The header's first field is the format's version (1); its dictionary says which stream
the entries came from.  A file that does not start with the header holds *plain values*:
each value is one entry (what ``dataspace stream append NAME -`` reads: one value per
line, or spanning lines, ``#`` comments allowed), so a value that looks like an
``<entry ...>`` record is only ever read as one after a header.

**Import** reads either format and either kind of file (:class:`Input`: a file whose
first byte is a binary Preserves tag, 0x80..0xBF -- a byte no UTF-8 text starts with --
is binary), and appends the values in transactions of many entries each
(:func:`import_stream`).  Bad input is a :class:`BadInput` naming the line (text) or the
byte offset (binary); what was committed before it stays, nothing of the batch that held
it is written (:class:`ImportStopped` says which).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, NamedTuple

from ..values import (
    DecodeError,
    Decoder,
    Dictionary,
    ParseEOF,
    ParseError,
    ParseShort,
    Record,
    Symbol,
    Value,
    decode,
    encode,
    stringify,
)
from ..values.text import parse_many, parse_prefix
from .base import (
    MAX_INDEX,
    MAX_VALUE_SIZE,
    Store,
    StoreCorrupt,
    StoreError,
    StreamNotFound,
    encode_value,
)
from .integrity import StreamDigest

__all__ = [
    "ENTRY",
    "FORMAT_VERSION",
    "HEADER",
    "MAX_TEXT_VALUE",
    "BadInput",
    "ExportResult",
    "ImportResult",
    "WriteMismatch",
    "ImportStopped",
    "Input",
    "Item",
    "export_stream",
    "header",
    "import_stream",
    "text_values",
]

HEADER = Symbol("dataspace-stream-export")
ENTRY = Symbol("entry")
FORMAT_VERSION = 1

MAX_TEXT_VALUE = 64 * 1024 * 1024
"""Longest text of one value an import reads (characters; a 16 MiB value written as
``#x"..."`` takes 32 M): more is :class:`BadInput`, not unbounded memory."""

_RETRY_ALWAYS = 1024  # below this many characters, a value spanning lines is parsed again at each line
_WS = re.compile(r"[ \t\r\n]*")


class WriteMismatch(StoreError):
    """What an export or import wrote is not what it read (the message says how)."""


class BadInput(ValueError):
    """Input that cannot be imported: the message names the place (``SOURCE line N,
    column C: ...`` or ``SOURCE byte N: ...``)."""


# -- reading Preserves text line by line ------------------------------------------------


def text_values(lines: Iterable[str], source: str = "stdin") -> Iterator[list[tuple[int, Value]]]:
    """Values of a text read line by line, each with the line it starts on (from 1).

    Yields, after each line that completes values, the list of them (a value may span
    lines; several may share one).  Errors are :class:`BadInput` with the line and column
    in the whole input: ``stdin line 4, column 4: unexpected '}'``.  A value longer than
    :data:`MAX_TEXT_VALUE` characters is an error too.  ``dataspace stream append -`` and
    ``dataspace stream import`` read their input through this.
    """
    pending = ""
    first = 1  # the line `pending` starts on
    lineno = 0
    failed_at = 0  # len(pending) when it last ended inside a value
    for line in lines:
        lineno += 1
        if not pending:
            first = lineno
            if not line.strip():
                continue
        pending += line
        if len(pending) > MAX_TEXT_VALUE:
            raise BadInput(f"{source} line {first}: a value longer than {MAX_TEXT_VALUE:,} "
                           "characters (lines ending inside it?)")
        if failed_at and len(pending) >= _RETRY_ALWAYS and len(pending) < 2 * failed_at:
            continue  # a long value spanning lines: parse again once it has doubled
        out, pending, first, short = _parse_chunk(pending, first, source)
        failed_at = len(pending) if short else 0
        if out:
            yield out
    if pending.strip():
        out, rest, at, _short = _parse_chunk(pending, first, source)
        if out:
            yield out
        if rest.strip() and not _only_comments(rest):
            raise BadInput(f"{source} ends inside a value (from line {at}): "
                           f"{rest.strip()[:60]!r}")


def _only_comments(text: str) -> bool:
    try:
        return not parse_many(text)
    except ParseError:
        return False


def _parse_chunk(text: str, first: int, source: str) -> tuple[list[tuple[int, Value]], str, int, bool]:
    """The complete values at the start of ``text`` (which starts on line ``first``),
    the rest (where a value is still open), the line the rest starts on, and whether the
    text ended inside a value."""
    out: list[tuple[int, Value]] = []
    pos = 0
    n = len(text)
    while True:
        start = _WS.match(text, pos).end()
        if start >= n:
            return out, "", first, False
        try:
            v, end = parse_prefix(text, pos, max_length=MAX_TEXT_VALUE)
        except ParseShort as e:
            if isinstance(e, ParseEOF) or not text[start:].strip():
                return out, "", first, False
            rest = text[pos:]
            return out, rest, first + text.count("\n", 0, pos), True
        except ParseError as e:
            if e.line is None:
                raise BadInput(f"{source} line {first + text.count(chr(10), 0, start)}: {e}") from e
            raise BadInput(f"{source} line {first + e.line - 1}, column {e.column}: {e.reason}") from e
        out.append((first + text.count("\n", 0, start), v))
        pos = end


# -- the items of an import ------------------------------------------------------------------


class Item(NamedTuple):
    """One entry to import: its encoded value and metadata, its index in the export
    (None for a plain value) and where it is in the input (``stdin line 12``,
    ``export.bin byte 340``)."""

    data: bytes
    meta: bytes | None
    index: int | None
    where: str


def header(stream: str, salvaged: bool = False) -> Record:
    """The header of an export of ``stream`` (``salvaged``: of the intact entries of a
    damaged stream, ``stream export --skip-damaged``: ``{stream: ..., salvaged: #t}``)."""
    info: dict[Value, Value] = {Symbol("stream"): stream}
    if salvaged:
        info[Symbol("salvaged")] = True
    return Record(HEADER, [FORMAT_VERSION, Dictionary(info)])


class Input:
    """What an import reads: ``f`` (a binary file) in ``fmt`` ``"text"``, ``"binary"`` or
    ``"auto"`` (binary when the first byte is a binary tag).  Iterating yields
    :class:`Item` s; ``header`` is the export header's dictionary once seen (None for
    plain values); ``consumed`` counts the bytes read so far; ``source`` names the input in
    messages."""

    def __init__(self, f: BinaryIO, fmt: str = "auto", source: str = "stdin") -> None:
        if fmt not in ("auto", "text", "binary"):
            raise ValueError(f"unknown format {fmt!r}: auto, text or binary")
        self.f = f
        self.source = source
        self.consumed = 0
        self.header: Dictionary | None = None
        self._first = b""
        self._seen = 0
        if fmt == "auto":
            self._first = f.read(1)
            self.consumed = len(self._first)
            fmt = "binary" if self._first and 0x80 <= self._first[0] <= 0xBF else "text"
        self.format = fmt

    def __iter__(self) -> Iterator[Item]:
        return self._binary() if self.format == "binary" else self._text()

    # text

    def _lines(self) -> Iterator[str]:
        first = self._first
        n = 0
        while True:
            raw = self.f.readline(MAX_TEXT_VALUE + 1)
            if first:
                raw, first = first + raw, b""
                self.consumed += len(raw) - 1
            else:
                self.consumed += len(raw)
            if not raw:
                return
            n += 1
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                col = len(raw[: e.start].decode("utf-8", "replace")) + 1
                raise BadInput(f"{self.source} line {n}, column {col}: not UTF-8 text "
                               "(binary Preserves? --format binary reads it)") from None

    def _text(self) -> Iterator[Item]:
        src = self.source
        for chunk in text_values(self._lines(), src):
            for line, v in chunk:
                item = self._item(v, f"{src} line {line}")
                if item is not None:
                    yield item

    # binary

    def _binary(self) -> Iterator[Item]:
        dec = Decoder(max_value_size=2 * MAX_VALUE_SIZE + 1024)
        fed = 0
        start = 0
        if self._first:
            dec.feed(self._first)
            fed = len(self._first)
        while True:
            while True:
                try:
                    v = dec.try_next()
                except DecodeError as e:
                    at = e.position if e.position is not None else start
                    raise BadInput(f"{self.source} byte {at}: {e.message}") from None
                if v is None:
                    break
                end = fed - dec.buffered
                item = self._item(v, f"{self.source} byte {start}")
                if item is not None:
                    yield item
                start = end
            data = self.f.read(1 << 16)
            if not data:
                break
            self.consumed += len(data)
            fed += len(data)
            dec.feed(data)
        if dec.buffered:
            raise BadInput(f"{self.source} byte {start}: the input ends inside a value "
                           f"({dec.buffered} bytes of it)")

    # both

    def _item(self, v: Value, place: str) -> Item | None:
        """The entry ``v`` is (None for the header)."""
        self._seen += 1
        if type(v) is Record and v.label == HEADER:
            if self._seen == 1:
                self._header(v, place)
                return None
            raise BadInput(f"{place}: an export header after the first value (concatenated "
                           "exports? import them one by one)")
        if self.header is None:
            return Item(self._encode(v, place, "value"), None, None, place)
        if type(v) is not Record or v.label != ENTRY or len(v.fields) not in (2, 3):
            raise BadInput(f"{place}: expected <entry INDEX VALUE> or <entry INDEX VALUE META> "
                           f"after the export header, found {_short(v)}")
        index = v.fields[0]
        if type(index) is not int or not 0 <= index < MAX_INDEX:
            raise BadInput(f"{place}: an entry's index is an integer from 0 to 2**63-2, not "
                           f"{_short(index)}")
        meta = self._encode(v.fields[2], place, "metadata") if len(v.fields) == 3 else None
        return Item(self._encode(v.fields[1], place, "value"), meta, index, place)

    def _header(self, v: Record, place: str) -> None:
        version = v.fields[0] if v.fields else None
        info = v.fields[1] if len(v.fields) > 1 else Dictionary()
        if type(version) is not int or not isinstance(info, Dictionary):
            raise BadInput(f"{place}: a malformed export header {_short(v)}")
        if version != FORMAT_VERSION:
            raise BadInput(f"{place}: export format version {version}; this version of "
                           f"dataspace reads version {FORMAT_VERSION} (upgrade it)")
        self.header = info

    @staticmethod
    def _encode(v: Value, place: str, what: str) -> bytes:
        try:
            return encode_value(v, what)
        except (ValueError, TypeError) as e:
            raise BadInput(f"{place}: {e}") from None


def _short(v: Value) -> str:
    text = stringify(v)
    return text if len(text) <= 60 else text[:57] + "..."


# -- import ---------------------------------------------------------------------------------


@dataclass
class ImportResult:
    """What :func:`import_stream` committed: ``entries`` at ``first``..``last``."""

    stream: str
    entries: int = 0
    first: int | None = None
    last: int | None = None
    batches: int = 0


class ImportStopped(Exception):
    """An import stopped at bad input or a store error: ``error`` is why, ``result``
    what was committed before it, ``resume`` where the batch that was not written starts
    in the input (``line 5001``, ``byte 40960``; None when it is unknown)."""

    def __init__(self, error: BaseException, result: ImportResult, resume: str | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.result = result
        self.resume = resume


def import_stream(
    store: Store,
    name: str,
    items: Iterable[Item],
    *,
    batch_size: int = 10_000,
    batch_bytes: int = 32 << 20,
    keep_indices: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ImportResult:
    """Append ``items`` to the stream ``name`` (created if absent), ``batch_size``
    entries (or ``batch_bytes``) per transaction; ``progress(entries)`` after each.

    With ``keep_indices`` every entry lands at its exported index (indices must follow
    each other from the stream's next index, or from any index at or after it into a
    stream without entries: a stream's entries have no gaps; plain values are refused);
    otherwise values
    get the stream's next indices.  Bad input, a failed write or Ctrl-C raises
    :class:`ImportStopped`; the batches committed before it stay (the stream is created
    with the first of them, or at the end of an input without entries).
    """
    result = ImportResult(name)
    datas: list[bytes] = []
    metas: list[bytes | None] = []
    indices: list[int] = []
    size = 0
    batch_at: str | None = None
    last_index = -1

    def flush() -> None:
        nonlocal size, batch_at
        with store.transaction() as tx:
            if keep_indices:
                nxt = tx.next_index(name)
                if indices and indices[0] < nxt:
                    raise BadInput(f"{batch_at}: index {indices[0]} is below the next index "
                                   f"of {name!r} ({nxt}): it has entries there already "
                                   "(import without --keep-indices appends at the end)")
                if indices and indices[0] > nxt and tx.first_index(name) is not None:
                    raise BadInput(f"{batch_at}: index {indices[0]} would leave indices "
                                   f"{nxt}..{indices[0] - 1} of {name!r} missing after its "
                                   "entries (a stream's entries have no gaps); import an "
                                   f"export from index {nxt} on, or into a new stream")
                now = time.time_ns()
                tx.copy_in(name, [(i, now, d, m, o) for o, (i, d, m)
                                  in enumerate(zip(indices, datas, metas))])
                first = indices[0]
            else:
                tx.create_stream(name)
                first = tx.append_encoded(name, datas, metas)
        last = indices[-1] if keep_indices else first + len(datas) - 1
        # What was written, read back (every entry verified), against what was read.
        read = StreamDigest()
        read.add(name, range(first, last + 1), datas, metas)
        got = store.digest(name, first, last + 1, values=True)
        what = read.differs(got)
        if what is not None:
            raise WriteMismatch(f"{name!r} in {store.display} holds {what} (indices "
                                f"{first}..{last} of the batch from {batch_at})")
        result.first = first if result.first is None else result.first
        result.last = last
        result.entries += len(datas)
        result.batches += 1
        datas.clear()
        metas.clear()
        indices.clear()
        size = 0
        batch_at = None
        if progress is not None:
            progress(result.entries)

    try:
        for item in items:
            if keep_indices:
                if item.index is None:
                    raise BadInput(f"{item.where}: --keep-indices needs an export (entries "
                                   "with their indices); this input holds plain values")
                if item.index <= last_index:
                    raise BadInput(f"{item.where}: index {item.index} after index "
                                   f"{last_index}: the indices of an export increase")
                if last_index >= 0 and item.index != last_index + 1:
                    raise BadInput(f"{item.where}: index {item.index} after index {last_index}: "
                                   "the indices of an export follow each other (a stream's "
                                   "entries have no gaps)")
                last_index = item.index
                indices.append(item.index)
            if batch_at is None:
                batch_at = item.where
            datas.append(item.data)
            metas.append(item.meta)
            size += len(item.data) + (len(item.meta) if item.meta else 0) + 64
            if len(datas) >= batch_size or size >= batch_bytes:
                flush()
        if datas:
            flush()
    except (BadInput, StoreError, ValueError, KeyboardInterrupt) as e:
        raise ImportStopped(e, result, batch_at) from e
    if not result.entries:
        store.create_stream(name)  # an empty export makes an empty stream
    return result


# -- export ---------------------------------------------------------------------------------


@dataclass
class ExportResult:
    """What :func:`export_stream` wrote: ``entries`` at ``first``..``last``."""

    stream: str
    entries: int = 0
    first: int | None = None
    last: int | None = None
    damaged: int = 0
    """With ``on_damage``: how many lines of damage were told (entries left out, runs of
    missing ones, refused reads)."""


def export_stream(
    store: Store,
    name: str,
    out: BinaryIO,
    *,
    fmt: str = "text",
    start: int = 0,
    stop: int | None = None,
    chunk: int = 1000,
    progress: Callable[[int, int | None], None] | None = None,
    on_damage: Callable[[str], None] | None = None,
) -> ExportResult:
    """Write the header and the entries of ``name`` with ``start <= index < stop`` to
    ``out`` (a binary file) in ``fmt`` (``"text"`` or ``"binary"``, see the module
    docstring).  ``stop`` defaults to the stream's next index when the export starts
    (what is appended meanwhile is not exported).  ``progress(done, total)`` is called
    after each chunk (``total`` counts the stored entries in the range).

    Raises :class:`~dataspace.streams.StreamNotFound`; in text, a stored value that does
    not decode is a ``ValueError`` naming its index (binary copies it as it is).  Every
    read is verified (a damaged entry or bookkeeping raises
    :class:`~dataspace.streams.StoreCorrupt`); at the end, what was written is checked
    against the stream's bookkeeping when the export started (count, first and last
    index) and against the checksums the store holds for that range
    (:class:`WriteMismatch` otherwise, naming entries retention removed meanwhile).

    With ``on_damage`` (``stream export --skip-damaged``, recovering a damaged stream),
    damage does not stop the export: every intact entry is written (read as
    :func:`.salvage.entries` reads), each damaged one -- a read refused, an entry that
    fails its checksum, a run of missing indices, in text a value that does not decode --
    is told to ``on_damage`` (one line) instead, and the header says ``salvaged: #t``.
    """
    if fmt not in ("text", "binary"):
        raise ValueError(f"unknown format {fmt!r}: text or binary")
    result = ExportResult(name)
    if on_damage is not None:
        told = on_damage

        def on_damage(line: str) -> None:
            result.damaged += 1
            told(line)

    if not store.has_stream(name):
        raise StreamNotFound(f"no stream named {name!r} in {store.display}")
    info: tuple[int, int | None] | None
    try:  # the stream's bookkeeping (its tailers play no part)
        info = store.next_index(name), store.first_index(name)
    except StoreCorrupt as e:
        if on_damage is None:
            raise
        on_damage(str(e))  # its bookkeeping is damaged: what is stored, as it is
        info = None
    if info is not None:
        nxt, first = info
        end = nxt if stop is None else min(stop, nxt)
        pos = max(start, first if first is not None else nxt)
    else:
        end, pos = MAX_INDEX if stop is None else stop, start
    total: int | None = max(0, end - pos) if info is not None else None
    text = fmt == "text"
    head = header(name, salvaged=on_damage is not None)
    out.write((stringify(head) + "\n").encode() if text else encode(head))
    if progress is not None:
        progress(0, total)
    entry_tag = encode(ENTRY)
    wrote = StreamDigest()
    start_at = expect = pos
    gaps: list[tuple[int, int]] = []  # what was not there when read (retention meanwhile)
    for idxs, values, metas in (_chunks(store, name, pos, end, chunk) if on_damage is None
                                else _salvaged(store, name, pos, end, chunk, on_damage,
                                               verified=info is not None)):
        if idxs and idxs[0] > expect:
            gaps.append((expect, idxs[0]))
        if idxs:
            expect = idxs[-1] + 1
        parts: list[bytes] = []
        written = []
        for idx, data, meta in zip(idxs, values, metas):
            if text:
                try:
                    parts.append(_text_line(name, idx, data, meta))
                except ValueError as e:
                    if on_damage is None:
                        raise
                    on_damage(f"stream {name!r}: {e}; left out")
                    continue
            else:
                parts += (b"\xb4", entry_tag, encode(idx), data, meta or b"", b"\x84")
            written.append((idx, data, meta))
        out.write(b"".join(parts))
        if written:
            i, v, m = (list(c) for c in zip(*written))
            wrote.add(name, i, v, m)
            result.first = i[0] if result.first is None else result.first
            result.last = i[-1]
            result.entries += len(i)
        if progress is not None:
            progress(result.entries, None if total is None else max(total, result.entries))
    if progress is not None and result.entries != total:
        progress(result.entries, result.entries)  # gaps in the range: it is all done
    if not result.damaged:
        if expect < end:
            gaps.append((expect, end))
        _verify_export(store, name, start_at, end, wrote, gaps)
    return result


def _chunks(store: Store, name: str, pos: int, end: int,
            chunk: int) -> Iterator[tuple[list[int], list[bytes], list[bytes | None]]]:
    """Verified reads of ``pos <= index < end``, as columns."""
    while pos < end:
        c = store.read_columns(name, pos, end, values=True, meta=True, limit=chunk)
        if not c.indices:
            return
        yield c.indices, c.values, c.metas
        pos = c.indices[-1] + 1


def _salvaged(store: Store, name: str, pos: int, end: int, chunk: int,
              on_damage: Callable[[str], None], verified: bool,
              ) -> Iterator[tuple[list[int], list[bytes], list[bytes | None]]]:
    """The intact entries of ``pos <= index < end`` (:func:`.salvage.entries`; without
    ``verified`` reads first, as stored: the stream's bookkeeping is damaged), as columns."""
    from .salvage import as_stored, entries

    batch: list[tuple[int, bytes, bytes | None]] = []
    read = entries if verified else as_stored
    for e in read(store, name, pos, end, chunk=chunk, on_damage=on_damage):
        batch.append((e.index, e.data, e.meta_data))
        if len(batch) >= chunk:
            yield tuple(list(c) for c in zip(*batch))  # type: ignore[misc]
            batch = []
    if batch:
        yield tuple(list(c) for c in zip(*batch))  # type: ignore[misc]


def _verify_export(store: Store, name: str, pos: int, end: int, wrote: StreamDigest,
                   gaps: list[tuple[int, int]]) -> None:
    """The export of ``pos <= index < end`` (what the stream's bookkeeping said when it
    started) wrote ``wrote``: all of it -- ``gaps`` are what its reads did not find
    (retention removed them meanwhile) -- with the same checksums as the store holds."""
    if end <= pos:
        return
    said = StreamDigest(end - pos, pos, end - 1)
    if gaps:
        spans = ", ".join(str(a) if b == a + 1 else f"{a}..{b - 1}" for a, b in gaps)
        raise WriteMismatch(
            f"entries {spans} of {name!r} were removed during the export (by retention?) and "
            f"are not in it ({wrote} were exported); stop the stream's writers and export "
            "again")
    if (wrote.count, wrote.first, wrote.last) != (said.count, said.first, said.last):
        raise WriteMismatch(f"{wrote} of {name!r} were exported where its bookkeeping said "
                            f"{said} when the export started")
    what = wrote.differs(store.digest(name, pos, end))
    if what is not None:
        raise WriteMismatch(f"{name!r} in {store.display} holds {what.replace(' were read', ' were exported')}")


def _text_line(name: str, index: int, data: bytes, meta: bytes | None) -> bytes:
    try:
        value = stringify(decode(data))
        tail = "" if meta is None else " " + stringify(decode(meta))
    except (DecodeError, ValueError) as e:
        raise ValueError(f"entry {index} of {name!r} does not decode ({e}); "
                         "--format binary exports it as stored") from None
    return f"<entry {index} {value}{tail}>\n".encode()
