"""Where the example's workers write down what happened, for the final table."""

from __future__ import annotations

import os
import sqlite3
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    task_id TEXT, task TEXT, key TEXT, event TEXT, fencing_token INTEGER,
    started REAL, ended REAL, holder TEXT, worker TEXT, note TEXT, sent_at REAL
)
"""


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(SCHEMA)
    return conn


def record(path: str, **event) -> None:
    event.setdefault("worker", f"pid {os.getpid()}")
    event.setdefault("started", time.time())
    columns = ", ".join(event)
    marks = ", ".join("?" for _ in event)
    with connect(path) as conn:
        conn.execute(f"INSERT INTO events ({columns}) VALUES ({marks})", tuple(event.values()))


def events(path: str) -> list[dict]:
    conn = connect(path)
    conn.row_factory = sqlite3.Row
    return [dict(row) for row in conn.execute("SELECT * FROM events ORDER BY started")]
