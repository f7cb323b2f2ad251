"""The operator's commands, against real stores holding real leases."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from celery_exclusive import marks
from celery_exclusive.backends import backend_for_url
from celery_exclusive.cli import exclusive
from celery_exclusive.lease import acquire
from tests.workers import ROOT


@pytest.fixture(params=["redis", "sqlite"])
def store(request):
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def held(store):
    """Two real leases, renewed by this process's heartbeat while the test runs."""
    backend = backend_for_url(store)
    leases = [
        acquire(backend, "exclusive:invoice:7", 30, name="billing.settle", task_id="task-7"),
        acquire(backend, "exclusive:invoice:8", 30, name="billing.settle", task_id="task-8"),
    ]
    yield leases
    for lease in leases:
        lease.release()


def run(store: str, *args: str, input: str | None = None):
    return CliRunner().invoke(exclusive, ["--backend", store, *args], input=input)


def test_ls_shows_each_lease_with_its_holder_and_token(store, held):
    result = run(store, "ls")
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    assert header.split() == [
        "key",
        "task",
        "id",
        "hostname",
        "pid",
        "age",
        "expires",
        "in",
        "fencing",
        "token",
        "marks",
    ]
    assert [row.split()[0] for row in rows] == ["exclusive:invoice:7", "exclusive:invoice:8"]
    assert "task-7" in rows[0] and str(os.getpid()) in rows[0]


def test_ls_json_gives_every_field(store, held):
    result = run(store, "ls", "--json")
    rows = json.loads(result.output)
    assert [r["task_id"] for r in rows] == ["task-7", "task-8"]
    first = rows[0]
    assert first["pid"] == os.getpid()
    assert first["fencing_token"] == held[0].fencing_token
    assert 0 < first["expires_in"] <= 30
    assert first["age"] >= 0
    assert first["task"] == "billing.settle"


def test_ls_with_nothing_held_says_so(store):
    assert run(store, "ls").output.strip() == "no leases held"


def test_inspect_accepts_the_key_without_its_prefix(store, held):
    result = run(store, "inspect", "invoice:7", "--json")
    data = json.loads(result.output)
    assert data["key"] == "exclusive:invoice:7"
    assert data["holders"][0]["task_id"] == "task-7"


def test_ls_shows_a_pending_rerun_and_the_line_beside_the_key(store, held):
    backend = backend_for_url(store)
    marks.join_rerun(backend, "exclusive:invoice:7", "task-9", "{}", 30)
    marks.take_place(backend, "exclusive:invoice:7", "task-9", 30)
    marks.take_place(backend, "exclusive:invoice:7", "nightly-1", 30, priority=True)
    rows = json.loads(run(store, "ls", "--json").output)
    assert rows[0]["marks"] == "rerun:task-9 line:nightly-1,task-9"
    assert rows[1]["marks"] == ""


def test_inspect_of_a_free_key_says_free(store):
    assert run(store, "inspect", "invoice:9").output.strip() == "exclusive:invoice:9: free"


def test_release_asks_first_and_does_nothing_when_refused(store, held):
    result = run(store, "release", "invoice:7", input="n\n")
    assert result.exit_code != 0
    assert "held by task task-7" in result.output
    assert backend_for_url(store).holders_of("exclusive:invoice:7")


def test_release_with_yes_frees_the_key_and_says_what_it_released(store, held):
    result = run(store, "release", "invoice:7", "--yes")
    assert result.exit_code == 0
    assert "released exclusive:invoice:7: 1 lease(s), held by task task-7" in result.output
    assert backend_for_url(store).holders_of("exclusive:invoice:7") == []


def test_watch_refreshes_the_table(store, held):
    result = run(store, "watch", "--count", "2", "--interval", "0.01")
    assert result.output.count("exclusive:invoice:7") == 2


def test_an_unreachable_store_is_a_one_line_error():
    result = run("redis://127.0.0.1:1/0", "ls")
    assert result.exit_code == 1
    assert "did not answer" in result.output and "Traceback" not in result.output


def test_the_celery_subcommand_reads_the_store_from_the_app(store, held):
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.ledger", "exclusive", "ls", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EXCLUSIVE_TEST_STORE": store, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert [r["key"] for r in json.loads(out.stdout)] == [
        "exclusive:invoice:7",
        "exclusive:invoice:8",
    ]


def test_the_standalone_command_needs_a_store():
    result = CliRunner().invoke(exclusive, ["ls"], env={"EXCLUSIVE_BACKEND_URL": ""})
    assert result.exit_code == 2
    assert "--backend" in result.output
