"""Durable streams: named, append-only logs of Preserves values.

>>> import tempfile, os
>>> from dataspace.values import parse
>>> d = tempfile.mkdtemp()
>>> store = open_store(d)                      # streams.sqlite3 in that directory
>>> store.append("chat", parse('<Says "alice" "hi">'))
0
>>> [e.value for e in store.read("chat")]
[Record(Symbol('Says'), ('alice', 'hi'))]
>>> t = store.tailer("chat", "bot")             # a named tailer: resumes after restarts
>>> [e.index for e in t.poll(timeout=1)]
[0]
>>> c = store.group("chat", "workers").consumer("w1")   # a consumer group: work shared
>>> [(d.index, c.ack(d)) for d in c.read(10)]
[(0, 1)]
>>> store.close()

* :mod:`.base` -- the storage interface (:class:`Store`, :class:`Transaction`, :class:`Entry`).
* :mod:`.open` -- :func:`open_store`: a path, ``sqlite:PATH`` or ``postgresql://...``.
* :mod:`.sqlite` -- the SQLite implementation (WAL, one file, no server).
* :mod:`.postgres` -- the PostgreSQL implementation (many machines, LISTEN/NOTIFY).
* :mod:`.wakeup` -- readers wake when data arrives, in-process and across processes.
* :mod:`.tailer` -- tailers with persisted positions.
* :mod:`.groups` -- consumer groups: entries shared by workers, acknowledged, redelivered.
* :mod:`.recorder` -- dataspace to stream (:class:`Recorder`) and back (:class:`Emitter`).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .base import (
    MAX_VALUE_SIZE,
    AckLost,
    Delivery,
    Entry,
    ForeignStore,
    Group,
    GroupInfo,
    GroupNotFound,
    LockHeld,
    PendingEntry,
    Store,
    StoreCorrupt,
    StoreError,
    StoreLock,
    StoreNotFound,
    StreamInfo,
    StreamNotFound,
    TailerInfo,
    Transaction,
    check_stream_name,
    check_user_name,
    is_reserved,
)

if TYPE_CHECKING:
    from .open import open_store
    from .recorder import (
        Emitter,
        Recorder,
        RecorderSpec,
        parse_recorder_spec,
        recorder_specs,
        start_recorders,
        stop_recorders,
    )
    from .sqlite import SQLiteStore
    from .tailer import Tailer

__all__ = [
    "MAX_VALUE_SIZE",
    "AckLost",
    "Delivery",
    "Emitter",
    "Entry",
    "ForeignStore",
    "Group",
    "GroupInfo",
    "GroupNotFound",
    "LockHeld",
    "PendingEntry",
    "Recorder",
    "RecorderSpec",
    "SQLiteStore",
    "Store",
    "StoreCorrupt",
    "StoreError",
    "StoreLock",
    "StoreNotFound",
    "StreamInfo",
    "StreamNotFound",
    "Tailer",
    "TailerInfo",
    "Transaction",
    "check_stream_name",
    "check_user_name",
    "is_reserved",
    "open_store",
    "parse_recorder_spec",
    "recorder_specs",
    "start_recorders",
    "stop_recorders",
]

_WHERE = {
    "open_store": "open",
    "Emitter": "recorder",
    "Recorder": "recorder",
    "RecorderSpec": "recorder",
    "parse_recorder_spec": "recorder",
    "recorder_specs": "recorder",
    "start_recorders": "recorder",
    "stop_recorders": "recorder",
    "SQLiteStore": "sqlite",
    "Tailer": "tailer",
}


__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
