"""Damage a real SQLite stream store file the ways disks and file systems do, every page
left well formed (SQLite then reads the file without an error), and change rows of either
store behind its back (:class:`Raw`): for tests/test_store_integrity.py and
tests/test_store_bookkeeping.py.

Call these on a closed store (nothing of it open in any process); they fold the
write-ahead log into the file first.  The layout is SQLite's file format: a b-tree page
starts with its type (2: interior of an index b-tree -- a WITHOUT ROWID table is one --,
10: its leaf), the count of cells at offset 3, and on an interior page the right-most
child at offset 8 and a cell pointer array at offset 12, each cell starting with its left
child's page number.
"""

from __future__ import annotations

import contextlib
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path

INTERIOR, LEAF = 2, 10


def checkpoint(path: Path) -> None:
    """Fold the write-ahead log into the file (so that damage to the file is what a
    reader sees) and leave the file in WAL mode, as the store keeps it."""
    with contextlib.closing(sqlite3.connect(path)) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")


@dataclass
class Tree:
    """The pages of the ``entries`` b-tree, in key order (leaves left to right)."""

    page_size: int
    root: int
    interiors: list[int]
    leaves: list[int]


def _page(data: bytes, n: int, size: int) -> tuple[int, bytes]:
    """(offset of the b-tree header, the page) of page ``n`` (1-based)."""
    page = data[(n - 1) * size:n * size]
    return (100 if n == 1 else 0), page


def _children(data: bytes, n: int, size: int) -> list[int]:
    h, page = _page(data, n, size)
    assert page[h] == INTERIOR, (n, page[h])
    cells = struct.unpack_from(">H", page, h + 3)[0]
    out = []
    for k in range(cells):
        at = struct.unpack_from(">H", page, h + 12 + 2 * k)[0]
        out.append(struct.unpack_from(">I", page, at)[0])
    out.append(struct.unpack_from(">I", page, h + 8)[0])
    return out


def tree(path: Path, table: str = "entries") -> Tree:
    """Walk the b-tree of ``table``."""
    with contextlib.closing(sqlite3.connect(path)) as c:
        root = c.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
        size = c.execute("PRAGMA page_size").fetchone()[0]
    data = path.read_bytes()
    interiors: list[int] = []
    leaves: list[int] = []

    def walk(n: int) -> None:
        h, page = _page(data, n, size)
        if page[h] == LEAF:
            leaves.append(n)
            return
        interiors.append(n)
        for child in _children(data, n, size):
            walk(child)

    walk(root)
    return Tree(size, root, interiors, leaves)


def _write(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def misdirect_child(path: Path, at: float = 0.5) -> tuple[int, int]:
    """Point the child pointer of an interior page that leads to the leaf at ``at``
    (a share of the leaves, in key order) to the next leaf instead: that leaf is then
    read twice and the other never -- as after a write that went to the wrong page.
    Returns (the leaf lost, the leaf read twice)."""
    checkpoint(path)
    t = tree(path)
    data = path.read_bytes()
    size = t.page_size
    target = t.leaves[min(int(len(t.leaves) * at), len(t.leaves) - 2)]
    nxt = t.leaves[t.leaves.index(target) + 1]
    for n in t.interiors:
        h, page = _page(data, n, size)
        cells = struct.unpack_from(">H", page, h + 3)[0]
        for k in range(cells):
            at_cell = struct.unpack_from(">H", page, h + 12 + 2 * k)[0]
            if struct.unpack_from(">I", page, at_cell)[0] == target:
                _write(path, (n - 1) * size + at_cell, struct.pack(">I", nxt))
                return target, nxt
        if struct.unpack_from(">I", page, h + 8)[0] == target:
            _write(path, (n - 1) * size + h + 8, struct.pack(">I", nxt))
            return target, nxt
    raise AssertionError(f"no interior page points to leaf {target}")


def cut_interior(path: Path, at: float = 0.33) -> int:
    """Cut the interior page that leads to the leaf at ``at`` (a share of the leaves,
    in key order) short after that leaf: its cell count lowered and its right-most child
    pointer set to that leaf, as an old version of the page written back over a newer
    one -- a well-formed page: range scans just end there.  Returns the leaf."""
    checkpoint(path)
    t = tree(path)
    data = path.read_bytes()
    size = t.page_size
    target = t.leaves[min(int(len(t.leaves) * at), len(t.leaves) - 2)]
    for n in t.interiors:
        h, page = _page(data, n, size)
        cells = struct.unpack_from(">H", page, h + 3)[0]
        for k in range(cells):
            at_cell = struct.unpack_from(">H", page, h + 12 + 2 * k)[0]
            if struct.unpack_from(">I", page, at_cell)[0] == target:
                base = (n - 1) * size + h
                _write(path, base + 3, struct.pack(">H", k))
                _write(path, base + 8, struct.pack(">I", target))
                return target
    raise AssertionError(f"no interior cell points to leaf {target}")


def zero_pages(path: Path, at: float = 0.33, count: int = 3) -> list[int]:
    """Overwrite ``count`` leaves from the share ``at`` of the way (in key order) with
    zeros, as a file system that lost writes leaves them (SQLite itself refuses to read
    them).  Returns their page numbers."""
    checkpoint(path)
    t = tree(path)
    first = min(int(len(t.leaves) * at), len(t.leaves) - count)
    pages = t.leaves[first:first + count]
    for n in pages:
        assert n != 1
        _write(path, (n - 1) * t.page_size, bytes(t.page_size))
    return pages


def copy_leaf(path: Path, at: float = 0.5) -> tuple[int, int]:
    """Overwrite the leaf at ``at`` with a copy of the first leaf (another page's
    content, every byte of it well formed).  Returns (the leaf overwritten, its source)."""
    checkpoint(path)
    t = tree(path)
    size = t.page_size
    src = t.leaves[0]
    dst = t.leaves[max(1, min(int(len(t.leaves) * at), len(t.leaves) - 1))]
    data = path.read_bytes()
    _write(path, (dst - 1) * size, data[(src - 1) * size:src * size])
    return dst, src


def flip_byte(path: Path, marker: bytes, delta: int = 0) -> int:
    """Flip the lowest bit of the byte ``delta`` bytes into the one occurrence of
    ``marker`` in the file (a value's bytes: the marker is part of it).  Returns the
    file offset."""
    checkpoint(path)
    data = path.read_bytes()
    at = data.find(marker)
    assert at >= 0 and data.find(marker, at + 1) < 0, "the marker must occur once"
    at += delta
    _write(path, at, bytes([data[at] ^ 1]))
    return at


class Raw:
    """SQL on a store's tables, bypassing the store (SQLite: its file; PostgreSQL: its
    database), as damage -- or a careless hand -- changes them."""

    def __init__(self, url: str) -> None:
        self.pg = url.startswith("postgresql:")
        if self.pg:
            import psycopg

            self.conn = psycopg.connect(url, autocommit=True)
            self.t = "dataspace."
        else:
            self.conn = sqlite3.connect(Path(url) / "streams.sqlite3", isolation_level=None)
            self.t = ""

    def __call__(self, sql: str, *params: object) -> list:
        sql = sql.replace("T.", self.t)
        if not self.pg:
            sql = sql.replace("%s", "?")
        cur = self.conn.execute(sql, params)
        return list(cur.fetchall()) if cur.description else []

    def sid(self, stream: str) -> int:
        return self("SELECT id FROM T.streams WHERE name = %s", stream)[0][0]

    @property
    def version(self) -> int:
        """The store's schema version (PostgreSQL: in store_meta; SQLite: user_version)."""
        if self.pg:
            return int(self("SELECT value FROM T.store_meta WHERE key = 'version'")[0][0])
        return int(self("PRAGMA user_version")[0][0])

    def set_version(self, version: int) -> None:
        """Mark the store as one of schema version ``version`` (its tables made so by
        hand): the next open migrates it."""
        if self.pg:
            self("UPDATE T.store_meta SET value = %s WHERE key = 'version'", str(version))
        else:
            self(f"PRAGMA user_version = {int(version)}")

    def flip(self, stream: str, index: int, offset: int = 3, column: str = "value") -> bool:
        """Flip the lowest bit of byte ``offset`` of an entry's value (or metadata); False
        when there is nothing to flip (an entry without metadata)."""
        blob = self(f"SELECT {column} FROM T.entries WHERE stream = %s AND idx = %s",
                    self.sid(stream), index)[0][0]
        if blob is None:
            return False
        blob = bytearray(blob)
        blob[offset % len(blob)] ^= 1
        self(f"UPDATE T.entries SET {column} = %s WHERE stream = %s AND idx = %s",
             bytes(blob), self.sid(stream), index)
        return True

    def close(self) -> None:
        self.conn.close()

    def flip_column(self, table: str, column: str, bit: int, stream: str,
                    tailer: str | None = None) -> bool:
        """Flip bit ``bit`` (0-63) of the 64-bit integer ``column`` of the row of
        ``stream`` in ``streams``, or of its tailer ``tailer`` in ``tailers``; False when
        the column is NULL (nothing to flip)."""
        sid = self.sid(stream)
        key, params = (("id = %s", (sid,)) if table == "streams"
                       else ("stream = %s AND name = %s", (sid, tailer)))
        old = self(f"SELECT {column} FROM T.{table} WHERE {key}", *params)[0][0]
        if old is None:
            return False
        new = old ^ (1 << bit)
        if new >= 1 << 63:
            new -= 1 << 64
        elif new < -(1 << 63):
            new += 1 << 64
        if self.pg and table == "streams" and column == "id":
            self("ALTER TABLE T.streams ALTER COLUMN id SET GENERATED BY DEFAULT")
        self(f"UPDATE T.{table} SET {column} = %s WHERE {key}", new, *params)
        return True
