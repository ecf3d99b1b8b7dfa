"""``dataspace stream``: look at and write durable streams (the embedded store)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..datadir import DATA_DIR_HELP, STREAMS_DB
from ..progress import Progress
from ..streams import StoreCorrupt, StoreError, check_user_name, is_reserved
from ..streams.base import (
    Delivery,
    Entry,
    GroupInfo,
    GroupNotFound,
    StreamInfo,
    StreamNotFound,
    parse_duration,
)
from ..streams.copy import CopyRefused, copy_streams
from ..streams.transfer import ImportStopped, Input, export_stream, import_stream, text_values
from ..values import ParseError, stringify
from ..values.text import parse_many
from ._json import to_json
from ._store import add_store_argument, open_data_store

EPILOG = """\
examples:
  dataspace stream ls                                streams, sizes, retention
  dataspace stream append chat '<Says "alice" "hi">' '<Says "bob" "yo">'
  printf '<n 1>\\n<n 2>\\n' | dataspace stream append nums -   values from stdin
  dataspace stream tail chat                         the last 10 entries
  dataspace stream tail chat -f                      then follow; Ctrl-C stops
  dataspace stream read chat --from 100 --count 20   entries 100..119
  dataspace stream ls --json | jq '.[].name'         as JSON (info --json too)
  dataspace stream tail chat -f --tailer me          resume as the tailer "me"
  dataspace stream info chat                         details, tailers, their lag
  dataspace stream create logs --max-count 100000 --max-age 7d   set retention
  dataspace stream ls --store postgresql://db/app    a PostgreSQL store
  dataspace stream copy ~/.local/share/dataspace postgresql://db/app
                                                     every stream to PostgreSQL
  dataspace stream export chat chat.pr               to a file (--format binary)
  dataspace stream export chat --from 100 --to 199   entries 100..199 to stdout
  dataspace stream import chat2 chat.pr              append an export's values
  dataspace stream rm chat2                          with entries and tailers
  dataspace stream group create jobs workers         workers share its entries
  dataspace stream consume jobs --group workers --consumer w1 --ack
                                                     take and acknowledge as w1
  dataspace stream group ls                          position, lag, pending

Every subcommand takes --store URL: a data directory or .sqlite3 file, sqlite:PATH, or
postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE (the password also from PGPASSWORD or
~/.pgpass); without it, the data directory's streams.sqlite3.
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "stream",
        help="list, read, follow and append to durable streams",
        description="Durable streams are named, append-only logs of Preserves values in a "
        f"store: the embedded one ({STREAMS_DB} in the data directory) or one named by "
        "--store URL (SQLite or PostgreSQL).  Entries have monotonic indices from 0; named "
        "tailers remember positions.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", metavar="DIR",
                        help=DATA_DIR_HELP)
    add_store_argument(common)
    ss = p.add_subparsers(dest="stream_command", metavar="SUBCOMMAND")

    ls = ss.add_parser(
        "ls", parents=[common], help="list streams",
        description="List streams: entries, index range, last append, retention.  With "
        "--json, one JSON array of objects, one per stream, with the fields of 'stream info "
        "--json' (without store): name, length, first, last, next (indices; first and last "
        "null when empty), created and last_time (seconds since the epoch), max_count, "
        "max_age (seconds), internal, tailers (a list of {name, position, lag, updated}), "
        "groups (its consumer groups, as 'stream group ls --json' gives them), "
        "damaged (null, or what is wrong with a damaged stream's bookkeeping: its other "
        "fields are then null).  A damaged stream is listed with the others, marked DAMAGED "
        "and named on standard error, and the exit status is 1.",
        epilog="examples:\n"
        "  dataspace stream ls\n"
        "  dataspace stream ls --all                    with the store's own (__...)\n"
        "  dataspace stream ls --json | jq -r '.[] | \"\\(.name) \\(.length)\"'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ls.add_argument("--all", "-a", action="store_true",
                    help="include internal streams (processor backing streams, __...)")
    ls.add_argument("--json", action="store_true",
                    help="print one JSON array (of objects, one per stream) instead of a table")
    ls.set_defaults(func=run_ls)

    info = ss.add_parser(
        "info", parents=[common], help="details of one stream",
        description="Details of a stream: index range, retention and every named tailer "
        "with its position and lag.  With --json, one JSON object: store, name, length, "
        "first, last, next, created, last_time, max_count, max_age, internal, tailers, "
        "groups (as 'stream ls --json'), and with --check an integrity object: ok, streams, "
        "entries, tailers, groups, pending, unsealed, problems (a list of lines).",
        epilog="examples:\n"
        "  dataspace stream info chat\n"
        "  dataspace stream info chat --check          also verify the whole store\n"
        "  dataspace stream info chat --json | jq .tailers",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    info.add_argument("name")
    info.add_argument("--check", action="store_true",
                      help="also check the whole store: the database's own check, every "
                      "stream's, tailer's and consumer group's bookkeeping row and every pending "
                      "entry's, and every entry of every stream read and verified (its "
                      "checksum, no index missing or twice)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=run_info)

    ap = ss.add_parser("append", parents=[common], help="append values (Preserves text)",
                       description="Append values given as Preserves text; '-' (or no value) "
                       "reads values from standard input (committed in batches as they "
                       "arrive).  The stream is created if needed.")
    ap.add_argument("name")
    ap.add_argument("values", nargs="*", metavar="VALUE")
    ap.set_defaults(func=run_append)

    tl = ss.add_parser(
        "tail", parents=[common], help="print the last entries; -f follows",
        description="Print entries as 'INDEX VALUE' lines.  With -f, keep printing entries "
        "as they are appended (by any process; readers are woken, not polling) until "
        "Ctrl-C.  A damaged stream: every intact entry is printed, each damaged entry (and "
        "run of missing ones) is named on standard error instead, and the exit status is "
        "1 (-f stops there).",
        epilog=_READ_EPILOG.replace("CMD", "tail"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    tl.add_argument("name")
    tl.add_argument("-n", "--lines", type=int, default=10, metavar="N",
                    help="how many of the last entries to print first (default 10; 0: none)")
    tl.add_argument("-f", "--follow", action="store_true", help="follow new entries")
    tl.add_argument("--from", dest="start", type=int, metavar="INDEX",
                    help="print from this index on (instead of the last N)")
    tl.add_argument("--tailer", metavar="NAME",
                    help="read as a named tailer: resume from its saved position, save it as we go")
    _print_arguments(tl)
    tl.set_defaults(func=run_tail)

    rd = ss.add_parser(
        "read", parents=[common], help="print entries from an index on",
        description="Print COUNT entries of a stream from index --from on (default: its "
        "first stored entry), as 'stream tail' prints them.  An index below the stream's "
        "first (retention removed it) or beyond its end is an error that says where the "
        "stream starts and ends.  A damaged stream: every intact entry is printed, each "
        "damaged entry (and run of missing ones) is named on standard error instead, and "
        "the exit status is 1.",
        epilog=_READ_EPILOG.replace("CMD", "read").replace(
            "examples:\n", "examples:\n"
            "  dataspace stream read chat                    its first 10 entries\n"
            "  dataspace stream read chat --from 100 -n 20   entries 100..119\n"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    rd.add_argument("name")
    rd.add_argument("--from", dest="start", type=_index, metavar="INDEX",
                    help="the first index to print (default: the first stored)")
    rd.add_argument("-n", "--count", type=_count, default=10, metavar="N",
                    help="how many entries to print at most (default 10)")
    _print_arguments(rd)
    rd.set_defaults(func=run_read)

    cr = ss.add_parser("create", parents=[common], help="create a stream / set its retention",
                       description="Create a stream if absent; with --max-count/--max-age set "
                       "its retention (older entries are deleted as new ones arrive).")
    cr.add_argument("name")
    cr.add_argument("--max-count", type=int, metavar="N", help="keep at most N entries")
    cr.add_argument("--max-age", metavar="DURATION", help="keep entries younger than this (90s, 15m, 12h, 7d)")
    cr.add_argument("--keep-all", action="store_true", help="remove both retention limits")
    cr.set_defaults(func=run_create)

    cp = ss.add_parser(
        "copy", help="copy streams to another store (SQLite <-> PostgreSQL)",
        description="Copy streams -- values, metadata, indices, append times, retention and "
        "named tailers -- from the store SRC to the store DST, keeping the order of commits "
        "across streams.  SRC and DST are store URLs: a data directory or .sqlite3 file, "
        "sqlite:PATH, postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE.  Every stream is "
        "copied, processor backing streams included (a pipeline carries on where it was on "
        "the new store), unless --streams says which.  Stop writers to SRC first: what is "
        "appended during the copy is not copied (and said so).  A progress bar on a "
        "terminal; otherwise a line every few seconds.",
        epilog="examples:\n"
        "  dataspace stream copy ~/.local/share/dataspace postgresql://app@db.example/app\n"
        "  dataspace stream copy postgresql://app@db/app ./backup --streams chat,orders\n"
        "  dataspace stream copy sqlite:old.sqlite3 sqlite:new.sqlite3 --replace",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    cp.add_argument("src", metavar="SRC", help="the store to copy from")
    cp.add_argument("dst", metavar="DST", help="the store to copy to (created if needed)")
    cp.add_argument("--streams", action="append", metavar="NAME[,NAME...]",
                    help="copy only these streams (repeatable; default: all)")
    cp.add_argument("--replace", action="store_true",
                    help="replace destination streams that already hold entries or tailers "
                    "(refused otherwise)")
    cp.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                    help="seconds between progress lines when not on a terminal (default 2)")
    cp.set_defaults(func=run_copy)

    ex = ss.add_parser(
        "export", parents=[common], help="write a stream's entries to a file (text or binary)",
        description="Write the entries of a stream to FILE (default '-': standard output) "
        "in the export format: a header, then one <entry INDEX VALUE> record per entry "
        "(<entry INDEX VALUE META> when it has metadata) -- in Preserves text, one per line "
        "(--format text, the default), or as canonical binary encodings one after the other "
        "(--format binary).  'dataspace stream import' reads it back.  Progress goes to "
        "standard error: a bar on a terminal, otherwise a line every --interval seconds; "
        "standard output holds only the export.  A FILE is written whole or not at all "
        "(FILE.part, renamed at the end).",
        epilog="examples:\n"
        "  dataspace stream export chat chat.pr                   the whole stream, text\n"
        "  dataspace stream export chat --from 100 --to 199       100..199 to stdout\n"
        "  dataspace stream export chat chat.bin --format binary\n"
        "  dataspace stream export chat saved.pr --skip-damaged   what is intact of it\n"
        "  dataspace stream export chat - | \\\n"
        "      dataspace stream import chat2 --store postgresql://app@db/app",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ex.add_argument("name", metavar="STREAM")
    ex.add_argument("file", nargs="?", default="-", metavar="FILE",
                    help="where to write ('-', the default: standard output)")
    ex.add_argument("--from", dest="start", type=int, metavar="N",
                    help="the first index to export (default: the first stored)")
    ex.add_argument("--to", dest="to", type=int, metavar="N",
                    help="the last index to export, included (default: the last when the "
                    "export starts)")
    ex.add_argument("--format", choices=("text", "binary"), default="text",
                    help="Preserves text, one entry per line (default), or binary")
    ex.add_argument("--skip-damaged", action="store_true",
                    help="recovering a damaged stream: export every intact entry, name each "
                    "damaged one (and each run of missing ones) on standard error instead, "
                    "keep the file and exit 1 (without it, damage stops the export and no "
                    "file is left)")
    _progress_arguments(ex)
    ex.set_defaults(func=run_export)

    im = ss.add_parser(
        "import", parents=[common], help="append the values of a file (an export, or plain values)",
        description="Append to STREAM the values of FILE (default '-': standard input): "
        "an export ('dataspace stream export': a header, then <entry INDEX VALUE> records) "
        "or plain values, one per line or spanning lines, as 'stream append NAME -' reads "
        "them.  Text or binary Preserves, told apart by the first byte (--format says which "
        "instead).  Values are written in transactions of --batch-size entries; bad input "
        "stops the import with its line (text) or byte offset (binary): the batches before "
        "it stay, nothing of the batch that holds it is written, and the message says what "
        "was imported.  Progress goes to standard error.  The stream is created if needed.",
        epilog="examples:\n"
        "  dataspace stream import chat chat.pr                   an export's values\n"
        "  dataspace stream import chat chat.pr --keep-indices    ...at their own indices\n"
        "  printf '<n 1>\\n<n 2>\\n' | dataspace stream import nums   values from stdin\n"
        "  dataspace stream import chat chat.bin --store postgresql://app@db.example/app\n"
        "\nexit status: 0 imported; 1 bad input or a store error (one line on stderr, with "
        "what was imported);\n2 bad arguments; 130 interrupted (Ctrl-C)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    im.add_argument("name", metavar="STREAM")
    im.add_argument("file", nargs="?", default="-", metavar="FILE",
                    help="what to read ('-', the default: standard input)")
    im.add_argument("--format", choices=("auto", "text", "binary"), default="auto",
                    help="the input's encoding (default: auto, by its first byte)")
    im.add_argument("--batch-size", type=int, default=10_000, metavar="N",
                    help="entries per transaction (default 10000)")
    im.add_argument("--keep-indices", action="store_true",
                    help="put each entry of an export at its own index (they must be at or "
                    "after the stream's next index) instead of appending at the end")
    _progress_arguments(im)
    im.set_defaults(func=run_import)

    rm = ss.add_parser(
        "rm", parents=[common], help="remove streams with their entries and tailers",
        description="Remove each stream NAME with all its entries and named tailers; its "
        "name can then be created afresh (indices from 0).  Nothing is asked: what was "
        "removed is printed.  Refused, and nothing removed, when a NAME does not exist, is "
        "one of the store's own (__...), or is read by a processor graph (a tailer "
        "GRAPH/PROCESSOR with its backing stream): the graph would go on from its old "
        "position in a new stream of that name -- reset it first (dataspace pipeline reset "
        "GRAPH.py), or remove anyway with --force.  Never while a graph reading it runs.  "
        "Stop the programs writing a stream (a server recording into it) before removing it.  "
        "Its consumer groups go with it (with their pending entries: said).",
        epilog="examples:\n"
        "  dataspace stream rm chat2                      remove one stream\n"
        "  dataspace stream rm tmp1 tmp2                  several (all or none)\n"
        "  dataspace stream rm chat --force               even though a graph reads it\n"
        "  dataspace stream rm __backing/old/p --force    an old graph's backing stream",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.add_argument("--force", action="store_true",
                    help="remove even a stream a graph reads, or one of the store's own (__...)")
    rm.set_defaults(func=run_rm)

    _register_groups(ss, common)

    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


_READ_EPILOG = """\
examples:
  dataspace stream CMD chat --meta --time      with metadata and append times
  dataspace stream CMD chat --json | jq -r .text
      one JSON object per line: index, time (seconds since the epoch), text
      (the value in Preserves text), value (mapped to JSON as `dataspace
      observe --json` maps values), meta and meta_text (null when none)

exit status: 0 printed; 1 no such stream, a bad index, a store error or damage
(named on standard error); 2 bad arguments"""


def _whole(noun: str, least: int) -> Callable[[str], int]:
    """An argument type: a whole number ``least`` or more (``noun`` names it in errors)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{noun} is {least} or more, not {n}")
        return n

    return parse


_index = _whole("an index", 0)
_count = _whole("a count", 1)


def _print_arguments(p: argparse.ArgumentParser, json_help: str = "one JSON object per line: "
                     "index, time, text, value, meta, meta_text (always all six)") -> None:
    p.add_argument("--meta", action="store_true", help="also print each entry's metadata")
    p.add_argument("--time", action="store_true", help="also print each entry's append time")
    p.add_argument("--no-index", action="store_true", help="print values only")
    p.add_argument("--json", action="store_true", help=json_help)


def _progress_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="seconds between progress lines when not on a terminal (default 2)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def _store(args: argparse.Namespace, create: bool = False) -> Any:
    return open_data_store(args.data_dir, create=create, store=args.store)


def _fail(msg: str) -> int:
    print(f"dataspace stream: {msg}", file=sys.stderr)
    return 1


def _ago(ns: int | None) -> str:
    if ns is None:
        return "-"
    t = datetime.datetime.fromtimestamp(ns / 1e9)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def _retention(s: StreamInfo) -> str:
    parts = []
    if s.max_count is not None:
        parts.append(_plural(s.max_count, 'entry', 'entries'))
    if s.max_age is not None:
        parts.append(_duration(s.max_age))
    return ", ".join(parts) or "keep all"


def _duration(seconds: float) -> str:
    for unit, n in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


def _stream_json(s: StreamInfo) -> dict[str, Any]:
    """A stream as ``stream ls --json`` and ``stream info --json`` give it (the field names
    of the web API's ``/api/streams``, and ``last``).  A damaged stream (``stream ls``
    lists it with the others): its name and ``damaged``, what is wrong in a few words
    (null for a sound stream); its other fields null."""
    if s.damaged is not None:
        return {"name": s.name, "length": None, "first": None, "last": None, "next": None,
                "created": None, "last_time": None, "max_count": None, "max_age": None,
                "internal": s.internal, "tailers": [], "groups": [], "damaged": s.damaged}
    return {
        "name": s.name,
        "length": s.count,
        "first": s.first,
        "last": None if s.first is None else s.next - 1,
        "next": s.next,
        "created": s.created_ns / 1e9,
        "last_time": None if s.last_time_ns is None else s.last_time_ns / 1e9,
        "max_count": s.max_count,
        "max_age": s.max_age,
        "internal": s.internal,
        "tailers": [t.as_json(s.next) for t in s.tailers],
        "groups": [_group_json(g) for g in s.groups],
        "damaged": None,
    }


def run_ls(args: argparse.Namespace) -> int:
    try:
        with _store(args) as store:
            streams = store.streams(include_internal=args.all, with_damaged=True)
            where = store.display
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    broken = [s for s in streams if s.damaged is not None]
    if args.json:
        print(json.dumps([_stream_json(s) for s in streams], ensure_ascii=False))
        return _damaged_streams(where, broken)
    if not streams:
        print("no streams yet (dataspace stream append NAME VALUE creates one)")
        return 0
    rows = [("NAME", "ENTRIES", "INDICES", "LAST APPEND", "RETENTION", "TAILERS", "GROUPS")]
    for s in streams:
        if s.damaged is not None:
            rows.append((s.name, "DAMAGED", "?", "?", "?", "?", "?"))
            continue
        rng = "-" if s.first is None else f"{s.first}..{s.next - 1}"
        rows.append((s.name, str(s.count), rng, _ago(s.last_time_ns), _retention(s),
                     str(len(s.tailers)), str(len(s.groups))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return _damaged_streams(where, broken)


def _damaged_streams(where: str, broken: list[StreamInfo]) -> int:
    """Each damaged stream said in one line on standard error (as a read of it says it);
    1 if any."""
    from ..streams.integrity import damaged

    sys.stdout.flush()
    for s in broken:
        _fail(str(damaged(where, s.name, s.damaged or "")))
    return 1 if broken else 0


def run_info(args: argparse.Namespace) -> int:
    s: StreamInfo | None
    damage: StoreCorrupt | None = None
    try:
        with _store(args) as store:
            try:
                s = store.stream_info(args.name)
            except StoreCorrupt as e:
                if not args.check:
                    raise
                # The check says what else is damaged (and this, in its words); the
                # error comes after it, saying what to do next.
                damage, s = e, None
            report = store.check_report() if args.check else None
            path = store.display
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    if args.json:
        out: dict[str, Any] = {"store": path}
        if s is not None:
            out.update(_stream_json(s))
        if report is not None:
            out["integrity"] = {"ok": not report.problems, "streams": report.streams,
                                "entries": report.entries, "tailers": report.tailers,
                                "groups": report.groups, "pending": report.pending,
                                "unsealed": report.unsealed, "problems": report.problems}
        print(json.dumps(out, ensure_ascii=False))
        if damage is not None:
            _damaged_after_check(damage, args.name, path)
        return 1 if s is None or (report is not None and report.problems) else 0
    if s is not None:
        print(f"stream      {s.name}")
        print(f"store       {path}")
        print(f"entries     {s.count}")
        print(f"indices     {'-' if s.first is None else f'{s.first}..{s.next - 1}'} (next append: {s.next})")
        print(f"created     {_ago(s.created_ns)}")
        print(f"last append {_ago(s.last_time_ns)}")
        print(f"retention   {_retention(s)}")
        if s.tailers:
            print("tailers")
            for t in s.tailers:
                print(f"  {t.name:<24} position {t.position:<12} lag {max(0, s.next - t.position):<10} "
                      f"saved {_ago(t.updated_ns)}")
        else:
            print("tailers     none")
        if s.groups:
            print("groups")
            for g in s.groups:
                print(f"  {g.name:<24} position {g.next:<12} lag {g.lag:<10} "
                      f"pending {g.pending}" + (f" (oldest {_idle(g.oldest_ns)} ago)"
                                                if g.oldest_ns is not None else ""))
                for c in g.consumers:
                    print(f"    {c.name:<22} pending {c.pending:<10} oldest {_idle(c.oldest_ns)} ago")
            held = _held_back(s)
            if held:
                print(f"retention   {held}")
    if report is not None:
        what = report.summary()
        if report.problems:
            print(f"integrity   PROBLEMS ({what}):")
            for pr in report.problems:
                print(f"  {pr}")
        else:
            print(f"integrity   ok ({what})")
    if damage is not None:
        _damaged_after_check(damage, args.name, path)
    return 0 if s is not None and (report is None or not report.problems) else 1


def _damaged_after_check(e: StoreCorrupt, name: str, where: str) -> None:
    """The damaged stream's one-line error after ``info --check``'s report: what to do
    next (not the check just run, which the error of any other command advises)."""
    if e.reason is None:  # (the store's damage as a whole: its own words)
        _fail(str(e))
        return
    stream = e.stream or name
    sys.stdout.flush()
    _fail(f"stream {stream!r} in {where} is damaged: {e.reason} (restore the store from a "
          f"backup, or save what is intact with `dataspace stream export {stream} FILE "
          "--skip-damaged`)")


def _read_stdin_batches(stream: Any) -> Any:
    """Yield lists of values from stdin as they arrive (a batch per burst of lines)."""
    batch: list[Any] = []
    fd_ok = True
    try:
        fileno = stream.fileno()
    except (OSError, AttributeError, ValueError):
        fd_ok = False
    for values in text_values(iter(stream.readline, ""), "stdin"):
        batch.extend(v for _line, v in values)
        more = False
        if fd_ok and len(batch) < 1000:
            try:
                more = bool(select.select([fileno], [], [], 0)[0])
            except (OSError, ValueError):
                more = False
        if not more or len(batch) >= 1000:
            yield batch
            batch = []
    if batch:
        yield batch


def run_append(args: argparse.Namespace) -> int:
    texts = args.values
    try:
        check_user_name(args.name)
        if texts and texts != ["-"]:
            values = []
            for t in texts:
                try:
                    values.append(*_one(t))
                except ParseError as e:
                    return _fail(f"cannot parse {t!r}: {e}")
            with _store(args, create=True) as store:
                r = store.append_many(args.name, values)
            print(f"appended {len(r)} to {args.name} (indices {r.start}..{r.stop - 1})")
            return 0
        total = 0
        first = None
        with _store(args, create=True) as store:
            for batch in _read_stdin_batches(sys.stdin):
                r = store.append_many(args.name, batch)
                first = r.start if first is None else first
                total += len(r)
        if total:
            print(f"appended {total} to {args.name} (indices {first}..{first + total - 1})")
        return 0
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))


def _one(text: str) -> list[Any]:
    vals = parse_many(text)
    if len(vals) != 1:
        raise ParseError(f"expected one value, found {len(vals)} (quote each value separately)")
    return vals


def _entry_json(e: Entry | Delivery) -> dict[str, Any]:
    """An entry as ``--json`` prints it, as the other commands print values (``send``,
    ``scry``): ``text`` the value in Preserves text (exact), ``value`` mapped to JSON
    (null when it does not decode), ``meta`` mapped and ``meta_text`` (null when none)."""
    try:
        v = e.value
        text, value = stringify(v), to_json(v)
    except Exception as err:  # intact, but not a value (appended as raw bytes): say so
        text, value = f"#!undecodable ({err}): {e.data[:32].hex()}", None
    meta = meta_text = None
    if e.meta_data is not None:
        try:
            m = e.meta
            meta_text, meta = stringify(m), to_json(m)
        except Exception:
            meta_text = "#!undecodable"
    return {"index": e.index, "time": e.time_ns / 1e9, "text": text, "value": value,
            "meta": meta, "meta_text": meta_text}


def _print(e: Entry, args: argparse.Namespace) -> None:
    if args.json:
        sys.stdout.write(json.dumps(_entry_json(e), ensure_ascii=False) + "\n")
        return
    try:
        text = stringify(e.value)
    except Exception as err:  # intact, but not a value (appended as raw bytes): say so
        text = f"#!undecodable ({err}): {e.data[:32].hex()}"
    meta = None
    if e.meta_data is not None:
        try:
            meta = stringify(e.meta)
        except Exception:
            meta = "#!undecodable"
    parts = []
    if not args.no_index:
        parts.append(str(e.index))
    if args.time:
        parts.append(datetime.datetime.fromtimestamp(e.time).isoformat(timespec="milliseconds"))
    parts.append(text)
    if args.meta and meta is not None:
        parts.append("meta " + meta)
    sys.stdout.write("  ".join(parts) + "\n")


class _Shown:
    """What ``tail`` and ``read`` printed, and the damage they met: each damaged entry (or
    run of missing ones, or the read that was refused) named on standard error, in order
    with the entries; exit status 1 at the end if any."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.entries = 0
        self.damage = 0

    def entry(self, e: Entry) -> None:
        _print(e, self.args)
        self.entries += 1

    def damaged(self, line: str) -> None:
        sys.stdout.flush()
        print(f"dataspace stream: {line}", file=sys.stderr, flush=True)
        self.damage += 1

    def finish(self) -> int:
        sys.stdout.flush()
        if not self.damage:
            return 0
        print(f"dataspace stream: {self.args.name!r} is damaged: "
              f"{_plural(self.entries, 'intact entry', 'intact entries')} printed, the damage "
              "named above left out", file=sys.stderr)
        return 1


def run_tail(args: argparse.Namespace) -> int:
    from ..streams.salvage import as_stored, last_entries

    if args.lines < 0:
        print("dataspace stream tail: -n must be >= 0", file=sys.stderr)
        return 2
    try:
        store = _store(args)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    shown = _Shown(args)
    try:
        if not store.has_stream(args.name):
            if not args.follow:
                return _fail(f"no stream named {args.name!r} (dataspace stream ls lists them)")
            # Following a stream that does not exist yet is allowed (it starts with the
            # first append), but a typo must not look like a quiet stream.
            print(f"dataspace stream: no stream named {args.name!r} yet; waiting for its "
                  "first entry (dataspace stream ls lists the streams; Ctrl-C stops)",
                  file=sys.stderr, flush=True)
        try:
            if args.tailer:
                # Resume as a named tailer: everything from its saved position (or --from).
                t = store.tailer(args.name, args.tailer, start="earliest")
                if args.start is not None:
                    t.seek(args.start)
            elif args.start is not None:
                t = store.tailer(args.name, start=args.start)
            else:
                # The last N of what is stored: not below the first stored index (retention,
                # or an import with --keep-indices), which the tailer would warn of as lost.
                first = store.first_index(args.name) or 0
                t = store.tailer(args.name, start=max(first, store.next_index(args.name) - args.lines))
        except StoreCorrupt as e:
            # The stream's bookkeeping (or the tailer's) is damaged: its end is not known
            # but from what is stored -- the last N intact entries of that, if asked for.
            shown.damaged(str(e))
            if not args.tailer:
                got = (list(as_stored(store, args.name, args.start, on_damage=shown.damaged))
                       if args.start is not None else
                       last_entries(store, args.name, args.lines, on_damage=shown.damaged))
                for x in got:
                    shown.entry(x)
            return shown.finish()
        # What is stored now, then (-f) what is appended, until Ctrl-C.
        caught_up = False
        with _stop_on_signals() if args.follow else contextlib.nullcontext():
            while True:
                try:
                    batch = t.poll(None) if caught_up else t.read(1000)
                except StoreCorrupt as e:
                    # Verified reads stop at damage (a named tailer is not moved past it):
                    # the rest as stored, intact entries printed, and no following.
                    shown.damaged(str(e))
                    for x in as_stored(store, args.name, t.position, on_damage=shown.damaged):
                        shown.entry(x)
                    return shown.finish()
                if not batch:
                    if not args.follow:
                        break
                    caught_up = True
                    continue
                for e in batch:
                    shown.entry(e)
                sys.stdout.flush()
        return shown.finish()
    except KeyboardInterrupt:
        return shown.finish()
    except (StoreError, ValueError) as e:
        return _fail(str(e))
    finally:
        store.close()


def run_read(args: argparse.Namespace) -> int:
    from ..streams.salvage import as_stored, entries

    try:
        store = _store(args)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    shown = _Shown(args)
    name = args.name
    try:
        if not store.has_stream(name):
            return _fail(f"no stream named {name!r} (dataspace stream ls lists them)")
        try:
            first = store.first_index(name)
            nxt = store.next_index(name)
        except StoreCorrupt as e:
            # Its bookkeeping is damaged: the intact entries stored in the range asked for.
            shown.damaged(str(e))
            start = args.start or 0
            for x in as_stored(store, name, start, start + args.count, on_damage=shown.damaged):
                shown.entry(x)
            return shown.finish()
        start = args.start
        if start is None:
            start = nxt if first is None else first
        if first is None and nxt == 0:
            return _fail(f"stream {name!r} holds no entries yet (`dataspace stream tail {name} -f` "
                         "waits for them)")
        if start < nxt and (first is None or start < first):
            if first is None:
                return _fail(f"entries 0..{nxt - 1} of {name!r} were removed by retention: it "
                             f"holds none now (its next append gets index {nxt})")
            return _fail(f"entries below index {first} of {name!r} are no longer stored "
                         f"(retention removed them): the stream starts at index {first} now "
                         f"(dataspace stream read {name} --from {first})")
        if start >= nxt:
            held = (f"its entries are {first}..{nxt - 1}" if first is not None
                    else "it holds none now")
            return _fail(f"index {start} is beyond the end of {name!r}: {held} and its next "
                         f"append gets index {nxt} (`dataspace stream tail {name} -f` waits "
                         "for new ones)")
        for x in entries(store, name, start, start + args.count, on_damage=shown.damaged):
            shown.entry(x)
        return shown.finish()
    except KeyboardInterrupt:
        return 130
    except (StoreError, ValueError) as e:
        return _fail(str(e))
    finally:
        store.close()


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Ctrl-C or SIGTERM stop a follow cleanly, like the other long-running commands --
    even when SIGINT came in ignored (a background job of a non-interactive shell), where
    Python would not raise KeyboardInterrupt on its own."""

    def stop(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    with _on_signals(stop):
        yield


@contextlib.contextmanager
def _on_signals(handler: Any) -> Iterator[None]:
    """``handler`` for Ctrl-C and SIGTERM (in the main thread) while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def run_create(args: argparse.Namespace) -> int:
    try:
        max_age = None if args.max_age is None else parse_duration(args.max_age)
        if args.max_count is not None and args.max_count < 1:
            raise ValueError("--max-count must be >= 1")
        check_user_name(args.name)
        with _store(args, create=True) as store:
            with store.transaction() as tx:
                tx.create_stream(args.name)
                if args.keep_all:
                    tx.set_retention(args.name, None, None)
                elif args.max_count is not None or max_age is not None:
                    old = store.stream_info(args.name) if store.has_stream(args.name) else None
                    tx.set_retention(
                        args.name,
                        args.max_count if args.max_count is not None else old and old.max_count,
                        max_age if max_age is not None else old and old.max_age,
                    )
            removed = store.apply_retention()
            s = store.stream_info(args.name)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    print(f"{s.name}: {_plural(s.count, 'entry', 'entries')}, retention {_retention(s)}"
          + (f" ({_plural(removed, 'old entry', 'old entries')} removed)" if removed else ""))
    return 0


def run_rm(args: argparse.Namespace) -> int:
    from ..pipeline.engine import graph_holder
    from ..pipeline.reset import graph_readers

    names = list(dict.fromkeys(args.names))
    try:
        with _store(args) as store:
            problems: list[str] = []
            infos: dict[str, StreamInfo] = {}
            readers: dict[str, list[str]] = {}
            for name in names:
                if not store.has_stream(name):
                    problems.append(f"no stream named {name!r} (dataspace stream ls lists them)")
                    continue
                if is_reserved(name) and not args.force:
                    problems.append(f"{name!r} is one of the store's own streams (a processor's "
                                    "backing stream); remove it with --force, or reset its "
                                    "graph (dataspace pipeline reset GRAPH.py)")
                    continue
                infos[name] = store.stream_info(name)
                readers[name] = graph_readers(store, name)
                graphs = sorted({r.split("/", 1)[0] for r in readers[name]})
                running = [f"{g} ({h})" for g in graphs if (h := graph_holder(store, g))]
                if running:
                    problems.append(f"stream {name!r} is read by the running graph "
                                    f"{', '.join(running)}; stop it first")
                elif readers[name] and not args.force:
                    problems.append(
                        f"stream {name!r} is read by graph {', '.join(graphs)} "
                        f"({', '.join(readers[name])}); it would go on from its old position "
                        "in a new stream of that name: reset it first (dataspace pipeline "
                        "reset GRAPH.py), or remove anyway with --force")
            if problems:
                for pr in problems:
                    print(f"dataspace stream rm: {pr}", file=sys.stderr)
                print("dataspace stream rm: nothing removed", file=sys.stderr)
                return 1
            for name in names:
                store.delete_stream(name)
                s = infos[name]
                groups = ""
                if s.groups:
                    pending = sum(g.pending for g in s.groups)
                    groups = f", {_plural(len(s.groups), 'consumer group')}" + (
                        f" with {_plural(pending, 'pending entry', 'pending entries')}"
                        if pending else "")
                print(f"removed {name} ({_plural(s.count, 'entry', 'entries')}, "
                      f"{_plural(len(s.tailers), 'tailer')}{groups})")
                if readers[name]:
                    print(f"dataspace stream rm: {name} was read by {', '.join(readers[name])}; "
                          "reset its graph (dataspace pipeline reset GRAPH.py) before it "
                          "reads a new stream of that name", file=sys.stderr)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    return 0


class CopyProgress(Progress):
    """The copy's progress (:class:`dataspace.progress.Progress`): a bar with rate and
    time left, rewritten in place on a terminal; otherwise a plain line at most every
    ``interval`` seconds (and the last)."""

    def __init__(self, out: Any, interval: float = 2.0, clock: Any = None,
                 header: str | None = None) -> None:
        super().__init__(out, what="entries", verb="copied", interval=interval, clock=clock,
                         header=header, redraw=0.0)


def run_copy(args: argparse.Namespace) -> int:
    from ..datadir import mask_url
    from ..streams import open_store

    names = None
    if args.streams:
        names = [n.strip() for item in args.streams for n in item.split(",") if n.strip()]
    if args.interval <= 0:
        print("dataspace stream copy: --interval must be > 0", file=sys.stderr)
        return 2
    src_text, dst_text = mask_url(args.src), mask_url(args.dst)
    try:
        with open_store(args.src, create=False) as src, open_store(args.dst) as dst:
            if src.url == dst.url:
                return _fail(f"copy: {src_text} and {dst_text} are the same store")
            progress = CopyProgress(sys.stdout, args.interval, header=(
                f"dataspace stream: copying from {src.display} to {dst.display} ..."))
            r = copy_streams(src, dst, names, replace=args.replace, progress=progress)
    except CopyRefused as e:
        return _fail(f"copy: {e}")
    except (StoreError, OSError, ValueError) as e:
        return _fail(f"copy: {e}")
    except KeyboardInterrupt:
        print("\ndataspace stream: copy interrupted; the destination holds part of it "
              "(run it again with --replace)", file=sys.stderr)
        return 130
    print(f"dataspace stream: copied {_plural(len(r.streams), 'stream')}, "
          f"{_plural(r.entries, 'entry', 'entries')}, {_plural(r.tailers, 'tailer')}"
          + (f" (replaced {', '.join(r.replaced)})" if r.replaced else ""))
    if r.appended_meanwhile:
        n = r.appended_meanwhile
        were = f"{_plural(n, 'entry was', 'entries were')}"
        print(f"dataspace stream: {were} appended to {src_text} "
              "during the copy and are not in the copy; stop its writers and copy again "
              "with --replace", file=sys.stderr)
    return 0


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else many or one + 's'}"


# -- export and import ---------------------------------------------------------------------------


def run_export(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("dataspace stream export: --interval must be > 0", file=sys.stderr)
        return 2
    if args.start is not None and args.start < 0:
        print("dataspace stream export: --from must be >= 0", file=sys.stderr)
        return 2
    if args.to is not None and args.to < (args.start or 0):
        print("dataspace stream export: --to must be >= --from (both are included)",
              file=sys.stderr)
        return 2
    to_stdout = args.file == "-"
    # Data on a terminal shows its own progress; a bar beside it would garble it.
    quiet = args.quiet or (to_stdout and sys.stdout.isatty())
    progress = Progress(sys.stderr, what="entries", verb="exported", interval=args.interval,
                        quiet=quiet)

    def damaged(line: str) -> None:
        sys.stdout.flush()
        progress.echo(f"dataspace stream: {line}", file=sys.stderr)

    try:
        with _store(args) as store:
            if not store.has_stream(args.name):
                return _fail(f"no stream named {args.name!r} (dataspace stream ls lists them)")
            stop = None if args.to is None else args.to + 1
            with _output(args.file) as out:
                r = export_stream(store, args.name, out, fmt=args.format, start=args.start or 0,
                                  stop=stop, progress=progress,
                                  on_damage=damaged if args.skip_damaged else None)
            progress.finish()
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error; keep Python quiet at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (StoreError, OSError, ValueError) as e:
        if progress.done:
            progress.finish()
        if isinstance(e, OSError) and e.strerror:
            return _fail(f"export: cannot write {args.file}: {e.strerror}")
        return _fail(f"export: {e}")
    where = "standard output" if to_stdout else args.file
    rng = "" if r.first is None else f" (indices {r.first}..{r.last})"
    if r.damaged:
        print(f"dataspace stream: exported the {_plural(r.entries, 'intact entry', 'intact entries')} "
              f"of {args.name}{rng} to {where}; the damage named above was left out (the "
              "export's header says salvaged: #t)", file=sys.stderr)
        return 1
    print(f"dataspace stream: exported {_plural(r.entries, 'entry', 'entries')} of "
          f"{args.name}{rng} to {where}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _output(path: str) -> Iterator[Any]:
    """Standard output's bytes for '-'; else the file PATH, written as PATH.part and
    renamed when complete (a device or a pipe named by PATH is written directly)."""
    if path == "-":
        sys.stdout.flush()
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "wb") as f:
            yield f
        return
    part = path + ".part"
    try:
        with open(part, "wb") as f:
            yield f
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.unlink(part)


def run_import(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.batch_size < 1:
        print("dataspace stream import: --interval must be > 0 and --batch-size >= 1",
              file=sys.stderr)
        return 2
    try:
        check_user_name(args.name)
    except ValueError as e:
        return _fail(str(e))
    source = "stdin" if args.file == "-" else args.file
    try:
        f = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")
    except OSError as e:
        return _fail(f"import: cannot read {args.file}: {e.strerror}")
    progress = Progress(sys.stderr, what="entries", verb="imported", interval=args.interval,
                        quiet=args.quiet)
    try:
        size = os.fstat(f.fileno()).st_size if os.path.isfile(args.file) else None
    except (OSError, ValueError):
        size = None
    try:
        inp = Input(f, args.format, source)

        def report(done: int) -> None:
            if not size:
                progress(done)
            elif inp.consumed < size:  # the total, estimated from the share read so far
                progress(done, max(round(done * size / max(inp.consumed, 1)), done + 1),
                         estimated=True)

        with _store(args, create=True) as store:
            r = import_stream(store, args.name, inp, batch_size=args.batch_size,
                              keep_indices=args.keep_indices, progress=report)
            if size:
                progress(r.entries, r.entries)
            progress.finish()
    except ImportStopped as e:
        r = e.result
        if r.entries:
            progress.finish()
        done = "nothing was imported" if not r.entries else (
            f"imported {_plural(r.entries, 'entry', 'entries')} to {args.name} "
            f"(indices {r.first}..{r.last}) before it")
        if r.entries and e.resume:
            done += f", nothing from {e.resume} on"
        if isinstance(e.error, KeyboardInterrupt):
            print(f"\ndataspace stream: import interrupted; {done}", file=sys.stderr)
            return 130
        return _fail(f"import: {e}; {done}")
    except (StoreError, OSError, ValueError) as e:
        if progress.done:
            progress.finish()
        return _fail(f"import: {e}")
    finally:
        if f is not sys.stdin.buffer:
            f.close()
    rng = "" if r.first is None else f" (indices {r.first}..{r.last})"
    print(f"imported {_plural(r.entries, 'entry', 'entries')} to {args.name}{rng}")
    return 0


# -- consumer groups ---------------------------------------------------------------------------

_GROUP_EPILOG = """\
examples:
  dataspace stream group create jobs workers               from the first entry
  dataspace stream group create jobs late --start latest   only new entries
  dataspace stream group create jobs w --max-deliveries 5 --idle-timeout 2m
  dataspace stream group ls                                every stream's groups
  dataspace stream group ls jobs workers                   consumers, pending
  dataspace stream group ack jobs workers 17 18            acknowledge by index
  dataspace stream group rm jobs workers"""


def _register_groups(ss: Any, common: argparse.ArgumentParser) -> None:
    gp = ss.add_parser(
        "group", help="consumer groups: workers sharing a stream's entries",
        description="A consumer group shares a stream's entries among workers (consumers): "
        "each entry is delivered to one consumer and stays pending with it until it is "
        "acknowledged; a consumer that restarts gets its own pending entries again first, "
        "and entries left idle longer than the group's --idle-timeout are claimed by another "
        "consumer's read.  'dataspace stream consume' is a consumer on the command line; "
        "from Python: store.group(STREAM, GROUP).consumer(NAME).read(...).",
        epilog=_GROUP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    gs = gp.add_subparsers(dest="group_command", metavar="SUBCOMMAND")

    cr = gs.add_parser(
        "create", parents=[common], help="create a consumer group on a stream",
        description="Create the consumer group GROUP on STREAM (the stream is created if "
        "absent).  Its first delivery is the entry at --start.  Retention never removes an "
        "entry the group has not acknowledged (a group that stops then holds the stream's "
        "retention back: `stream info` says so), unless --no-hold-retention.",
        epilog=_GROUP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    cr.add_argument("stream", metavar="STREAM")
    cr.add_argument("group", metavar="GROUP")
    cr.add_argument("--start", default="earliest", metavar="WHERE",
                    help="earliest (the first stored entry, the default), latest (entries "
                    "appended from now on) or an index")
    cr.add_argument("--idle-timeout", default="30s", metavar="DURATION",
                    help="how long an entry may stay pending, unacknowledged, before another "
                    "consumer's read claims it (default 30s; 'never': only by hand)")
    cr.add_argument("--max-deliveries", type=int, metavar="K",
                    help="move an entry delivered K times without an acknowledgement to the "
                    "dead-letter stream instead of delivering it again (default: no limit)")
    cr.add_argument("--dead-letter", metavar="STREAM",
                    help="the dead-letter stream (default: STREAM.dead)")
    cr.add_argument("--no-hold-retention", action="store_true",
                    help="let the stream's retention remove entries the group has not "
                    "acknowledged (the group then skips them, with a warning)")
    cr.set_defaults(func=run_group_create)

    ls = gs.add_parser(
        "ls", parents=[common], help="consumer groups, their position, lag and pending entries",
        description="List consumer groups (of every stream, or of STREAM): POSITION is the "
        "next index the group delivers, LAG how many entries it has not been delivered yet, "
        "PENDING how many are delivered and not acknowledged, OLDEST how long the oldest of "
        "those has waited.  With GROUP, that group's settings, its consumers and its pending "
        "entries (--limit of them).  With --json, one array of objects: stream, name, next, "
        "lag, pending, first_pending, oldest_idle (seconds), idle_timeout, max_deliveries, "
        "dead_letter, hold_retention, created, consumers (a list of {name, pending, "
        "oldest_idle, newest_idle}); with GROUP also entries (a list of {index, consumer, "
        "deliveries, idle}).",
        epilog=_GROUP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ls.add_argument("stream", nargs="?", metavar="STREAM")
    ls.add_argument("group", nargs="?", metavar="GROUP")
    ls.add_argument("--limit", type=_count, default=20, metavar="N",
                    help="pending entries to show of one GROUP (default 20)")
    ls.add_argument("--json", action="store_true", help="print one JSON array")
    ls.set_defaults(func=run_group_ls)

    rm = gs.add_parser("rm", parents=[common], help="remove a consumer group",
                       description="Remove the consumer group GROUP of STREAM with its pending "
                       "list (the stream's entries stay).",
                       epilog=_GROUP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    rm.add_argument("stream", metavar="STREAM")
    rm.add_argument("group", metavar="GROUP")
    rm.set_defaults(func=run_group_rm)

    ack = gs.add_parser("ack", parents=[common], help="acknowledge pending entries by index",
                        description="Acknowledge entries of STREAM pending with GROUP, whichever "
                        "consumer holds them: they are not delivered again.",
                        epilog=_GROUP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ack.add_argument("stream", metavar="STREAM")
    ack.add_argument("group", metavar="GROUP")
    ack.add_argument("indices", nargs="+", type=_index, metavar="INDEX")
    ack.set_defaults(func=run_group_ack)

    gp.set_defaults(func=lambda a: (gp.print_help(), 2)[1])

    co = ss.add_parser(
        "consume", parents=[common], help="take a stream's entries as a consumer of a group",
        description="Print entries of STREAM delivered to CONSUMER of the consumer group "
        "GROUP, one per line ('INDEX VALUE', as 'stream tail' prints them): first those "
        "pending with CONSUMER from an earlier run, then entries other consumers left idle "
        "past the group's idle timeout, then new ones, waiting for more until Ctrl-C (or -n, "
        "--timeout).  With --ack each entry is acknowledged once printed (in batches): it is "
        "not delivered again; without, entries stay pending with CONSUMER (acknowledge them "
        "with 'stream group ack', or they go to another consumer once idle).  Ctrl-C stops "
        "cleanly, after the batch being printed and acknowledged; an entry delivered but not "
        "printed (Ctrl-C in the middle of a read) is delivered again (at least once).",
        epilog="examples:\n"
        "  dataspace stream consume jobs --group workers --consumer w1 --ack\n"
        "  dataspace stream consume jobs -g workers -c w1 -n 10        ten, left pending\n"
        "  dataspace stream consume jobs -g workers -c w1 --ack --timeout 5 --json\n"
        "\nexit status: 0 stopped (Ctrl-C, -n, --timeout); 1 no such stream or group, a store "
        "error or damage; 2 bad arguments",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    co.add_argument("name", metavar="STREAM")
    co.add_argument("-g", "--group", required=True, metavar="GROUP",
                    help="the consumer group (dataspace stream group create makes one)")
    co.add_argument("-c", "--consumer", required=True, metavar="CONSUMER",
                    help="this consumer's name within the group (the same name after a "
                    "restart gets its pending entries back)")
    co.add_argument("--ack", action="store_true",
                    help="acknowledge each entry once printed")
    co.add_argument("-n", "--count", type=_count, metavar="N",
                    help="stop after N entries (default: go on until Ctrl-C)")
    co.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                    help="stop when nothing came for this long (default: wait for ever)")
    _print_arguments(co, "one JSON object per line: index, time, text, value, meta, "
                     "meta_text (as 'stream tail --json') and deliveries (how many times the "
                     "entry was delivered, this time included)")
    co.set_defaults(func=run_consume)


def _seconds(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _idle(ns: int | None, now: float | None = None) -> str:
    """How long ago ``ns`` was: ``12s``, ``3m 20s``, ``2h 5m``, ``4d 2h``."""
    if ns is None:
        return "-"
    s = max(0, int((now if now is not None else time.time()) - ns / 1e9))
    for unit, n, sub, m in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= n:
            rest = (s % n) // m
            return f"{s // n}{unit}" + (f" {rest}{sub}" if rest else "")
    return f"{s}s"


def _group_json(g: GroupInfo, now: float | None = None) -> dict[str, Any]:
    """A consumer group as ``stream group ls --json`` (and ``stream ls --json``) give it."""
    return {"stream": g.stream, **g.as_json(now)}


def _held_back(s: StreamInfo) -> str | None:
    """What holds the retention of ``s`` back (a group that has not acknowledged entries
    beyond its --max-count), or None."""
    if s.max_count is None or s.count <= s.max_count:
        return None
    cut = s.next - s.max_count
    holders = sorted((g.floor, g.name) for g in s.groups if g.hold_retention and g.floor < cut)
    if not holders:
        return None
    floor, name = holders[0]
    return (f"held back at index {floor} by consumer group {name!r}, which has not "
            f"acknowledged {_plural(cut - floor, 'entry', 'entries')} retention would remove "
            f"(dataspace stream group ls {s.name} {name})")


def _group_settings(g: GroupInfo) -> str:
    idle = "never claimed by a read" if g.idle_timeout is None else \
        f"idle timeout {_duration(g.idle_timeout)}"
    dead = ("no delivery limit" if g.max_deliveries is None else
            f"after {_plural(g.max_deliveries, 'delivery', 'deliveries')} to {g.dead_letter}")
    hold = "holds retention" if g.hold_retention else "does not hold retention"
    return f"{idle}, {dead}, {hold}"


def run_group_create(args: argparse.Namespace) -> int:
    try:
        check_user_name(args.stream)
        start: int | str = args.start
        if args.start not in ("earliest", "latest"):
            try:
                start = int(args.start)
            except ValueError:
                raise ValueError(f"--start {args.start!r}: give earliest, latest or an index") from None
        idle = None if args.idle_timeout == "never" else parse_duration(args.idle_timeout)
        with _store(args, create=True) as store:
            g = store.create_group(args.stream, args.group, start=start, idle_timeout=idle,
                                   max_deliveries=args.max_deliveries,
                                   dead_letter=args.dead_letter,
                                   hold_retention=not args.no_hold_retention)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    print(f"created group {g.name} on {g.stream}, first delivering index {g.next} "
          f"({_group_settings(g)})")
    return 0


def run_group_ls(args: argparse.Namespace) -> int:
    if args.group is not None and args.stream is None:
        return _fail("give the stream of the group")
    try:
        with _store(args) as store:
            if args.group is not None:
                groups = [store.group_info(args.stream, args.group)]
                entries = store.group_pending(args.stream, args.group, limit=args.limit)
            else:
                groups = store.groups(args.stream)
                entries = []
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    now = time.time()
    if args.json:
        out = [_group_json(g, now) for g in groups]
        if args.group is not None:
            out[0]["entries"] = [{"index": p.index, "consumer": p.consumer,
                                  "deliveries": p.deliveries,
                                  "idle": max(0.0, now - p.delivered_ns / 1e9)} for p in entries]
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if args.group is not None:
        g = groups[0]
        print(f"group       {g.name} of {g.stream}")
        print(f"position    {g.next} (lag {g.lag}: entries not delivered yet)")
        print(f"pending     {g.pending}" + (f", oldest {_idle(g.oldest_ns, now)} ago"
                                             if g.oldest_ns is not None else ""))
        print(f"settings    {_group_settings(g)}")
        print(f"created     {_ago(g.created_ns)}")
        if g.consumers:
            print("consumers")
            for c in g.consumers:
                print(f"  {c.name:<24} pending {c.pending:<8} oldest {_idle(c.oldest_ns, now)}"
                      f", newest {_idle(c.newest_ns, now)} ago")
        if entries:
            print("pending entries" + (f" (the first {len(entries)} of {g.pending})"
                                       if len(entries) < g.pending else ""))
            for p in entries:
                print(f"  {p.index:<12} {p.consumer:<24} delivered {p.deliveries}x, "
                      f"{_idle(p.delivered_ns, now)} ago")
        return 0
    if not groups:
        where = f" on {args.stream}" if args.stream else ""
        print(f"no consumer groups{where} yet (dataspace stream group create STREAM GROUP "
              "makes one)")
        return 0
    rows = [("STREAM", "GROUP", "POSITION", "LAG", "PENDING", "CONSUMERS", "OLDEST")]
    for g in groups:
        rows.append((g.stream, g.name, str(g.next), str(g.lag), str(g.pending),
                     str(len(g.consumers)), _idle(g.oldest_ns, now)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def run_group_rm(args: argparse.Namespace) -> int:
    try:
        with _store(args) as store:
            g = store.group_info(args.stream, args.group)
            store.delete_group(args.stream, args.group)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    print(f"removed group {g.name} of {g.stream}"
          + (f" ({_plural(g.pending, 'pending entry', 'pending entries')})" if g.pending else ""))
    return 0


def run_group_ack(args: argparse.Namespace) -> int:
    want = list(dict.fromkeys(args.indices))
    try:
        with _store(args) as store:
            n = store.group(args.stream, args.group, create=False).ack(want)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    rest = len(want) - n
    print(f"acknowledged {n} of {len(want)}" + (f" ({rest} {'was' if rest == 1 else 'were'} not "
                                                "pending)" if rest else ""))
    return 0


def run_consume(args: argparse.Namespace) -> int:
    try:
        store = _store(args)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    shown = acked = 0
    busy = [False]  # printing and acknowledging a batch: Ctrl-C waits for its end
    stop = [False]

    def on_signal(_signum: int, _frame: Any) -> None:
        if busy[0]:
            stop[0] = True
        else:
            raise KeyboardInterrupt

    interrupted = False
    try:
        g = store.group(args.name, args.group, create=False)
        c = g.consumer(args.consumer)
        with _on_signals(on_signal):
            while (args.count is None or shown < args.count) and not stop[0]:
                want = 100 if args.count is None else min(100, args.count - shown)
                got = c.read(want, block=args.timeout if args.timeout is not None else 3600.0)
                if not got:
                    if args.timeout is not None:
                        break
                    continue
                busy[0] = True
                for d in got:
                    if args.json:
                        sys.stdout.write(json.dumps(_delivery_json(d), ensure_ascii=False) + "\n")
                    else:
                        _print(d, args)
                sys.stdout.flush()
                shown += len(got)
                if args.ack:
                    acked += c.ack(got)
                busy[0] = False
        interrupted = stop[0]
    except KeyboardInterrupt:
        interrupted = True
    except StreamNotFound:
        store.close()
        return _fail(f"no stream named {args.name!r} (dataspace stream ls lists them)")
    except GroupNotFound:
        store.close()
        return _fail(f"no consumer group {args.group!r} on {args.name!r}; create it: "
                     f"dataspace stream group create {args.name} {args.group}")
    except (StoreError, ValueError) as e:
        store.close()
        return _fail(str(e))
    store.close()
    what = f"{_plural(shown, 'entry', 'entries')} to {args.consumer} of group {args.group}"
    if args.ack:
        what += f", {acked} acknowledged"
    elif shown:
        what += (", left pending (dataspace stream group ack "
                 f"{args.name} {args.group} INDEX... acknowledges them)")
    print(f"dataspace stream: delivered {what}" + (" (interrupted)" if interrupted else ""),
          file=sys.stderr)
    return 0


def _delivery_json(d: Delivery) -> dict[str, Any]:
    return {**_entry_json(d), "deliveries": d.deliveries}
