"""A result stored with the release of its lease, in one step.

Where Celery's result backend is Redis on the lease store's server, the script that
frees the lease stores and publishes the result, only if the lease was still held:
Celery's own read-then-write of the result is left out. The specs watch the server's
command stream (``MONITOR``), which tells a script's commands from a client's.
"""

from __future__ import annotations

import re
import threading

import pytest
from celery import chain

from celery_exclusive import LeaseLost
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack
from tests.support.workers import read_ledger

RESULT_KEY = "celery-task-meta-"


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    with stack.running(stack.worker("results", pool="prefork", concurrency=1)):
        yield stack


@pytest.fixture
def cluster(stack):
    stack.reset()
    return stack


class Monitor:
    """Every command the server runs while the ``with`` block does, as MONITOR prints it."""

    def __init__(self, server) -> None:
        self.client = server.client(0)
        self.lines: list[str] = []
        self.marker = "monitor-stop"

    def __enter__(self) -> Monitor:
        self.monitor = self.client.monitor()
        self.monitor.__enter__()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        while True:
            command = self.monitor.next_command()
            line = (
                f"[{command['client_type']} {command.get('client_address', '')}] "
                + command["command"]
            )
            if self.marker in command["command"]:
                return
            self.lines.append(line)

    def __exit__(self, *exc_info) -> None:
        self.client.echo(self.marker)
        self.thread.join(10)
        self.monitor.__exit__(*exc_info)

    def touching(self, task_id: str) -> list[str]:
        """The commands that named the result key of ``task_id``."""
        return [line for line in self.lines if RESULT_KEY + task_id in line]


def writes(lines: list[str]) -> list[str]:
    return [line for line in lines if re.search(r"\] (SET|SETEX|PSETEX) ", line)]


@pytest.mark.parametrize(
    "task", [ledger_app.hold_skip, ledger_app.hold_acks_late], ids=["plain", "acks_late"]
)
def test_the_result_is_stored_by_the_release_script_and_by_no_client(cluster, task):
    with Monitor(cluster.server) as monitor:
        results = [task.delay(f"with-release-{i}", 0) for i in range(5)]
        values = [r.get(timeout=60) for r in results]
    assert [v["task_id"] for v in values] == [r.id for r in results]
    for result in results:
        stored = writes(monitor.touching(result.id))
        assert len(stored) == 1, stored
        assert stored[0].startswith("[lua"), stored  # from the release script, not a client


def test_the_stored_result_holds_every_field_celerys_own_store_writes(cluster):
    # A task with a callback keeps Celery's own store (its link is sent first).
    by_celery = ledger_app.hold_skip.apply_async(
        ("by-celery", 0), link=ledger_app.hold_two.si("callback", 0)
    )
    by_release = ledger_app.hold_skip.delay("by-release", 0)
    by_celery.get(timeout=60)
    by_release.get(timeout=60)
    by_celery.children[0].get(timeout=60)  # the callback ran, before the next spec
    backend = ledger_app.app.backend
    ours = backend.get_task_meta(by_release.id)
    theirs = backend.get_task_meta(by_celery.id)
    assert set(ours) == set(theirs)
    assert ours["status"] == "SUCCESS" and ours["result"]["key"] == "by-release"
    assert ours["args"] == ["by-release", 0] and ours["name"] == "ledger.hold_skip"
    stored_ttl = backend.client.ttl(backend.get_key_for_task(by_release.id))
    assert 0 < stored_ttl <= backend.expires


def test_a_run_whose_lease_was_taken_before_it_returned_stores_leaselost_not_its_success(
    cluster,
):
    result = ledger_app.taken_before_it_returns.delay("taken-away")
    with pytest.raises(LeaseLost):
        result.get(timeout=60, propagate=True)
    assert result.state == "FAILURE"
    ran = [entry for entry in read_ledger(cluster.ledger) if entry["key"] == "taken-away"]
    assert [entry["task_id"] for entry in ran] == [result.id]  # the body ran to its end


def test_a_chain_keeps_celerys_own_store_and_sends_each_link_after_the_release(cluster):
    links = chain(ledger_app.hold_skip.si("chained-result", 0) for _ in range(4))
    with Monitor(cluster.server) as monitor:
        last = links.apply_async()
        last.get(timeout=60)
    ids = []
    node = last
    while node is not None:
        ids.append(node.id)
        node = node.parent
    by_client = [
        line for task_id in ids[1:] for line in writes(monitor.touching(task_id)) if "[lua" in line
    ]
    assert by_client == []  # every link but the last stored its result Celery's way
    [last_write] = writes(monitor.touching(ids[0]))
    assert last_write.startswith("[lua")  # the last link has nothing to send first
    assert len([e for e in read_ledger(cluster.ledger) if e["key"] == "chained-result"]) == 4
