"""A new SQLite file opened by many connections at once (workers starting together on
a fresh default store): every one of them opens it and answers, none reports the store
unavailable. Switching a new file into WAL mode takes its lock without waiting for it,
and SQLite answers "database is locked" at once to the connections that lose that race.
"""

from __future__ import annotations

import threading

from celery_exclusive.backends import backend_for_url

#: Connections opening each new file together, and how many new files.
CONNECTIONS, FILES = 6, 40


def test_connections_opening_a_new_file_together_all_open_it(tmp_path):
    failures = []
    for number in range(FILES):
        backend = backend_for_url(f"sqlite:///{tmp_path}/leases{number}.db")
        together = threading.Barrier(CONNECTIONS)

        def open_and_read(backend=backend, together=together) -> None:
            together.wait(10)
            try:
                backend.read_record("exclusive:k:celery-exclusive:layout", "sqlite")
            except Exception as exc:  # the failure is the finding
                failures.append(exc)

        threads = [threading.Thread(target=open_and_read) for _ in range(CONNECTIONS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert failures == []
