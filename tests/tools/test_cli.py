"""The operator's commands, against real stores holding real leases."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import psycopg
import pytest
import redis
from click.testing import CliRunner

from celery_exclusive import ExclusiveLock
from celery_exclusive.backends import backend_for_url

# The package's group, with every command registered on it (web too).
from celery_exclusive.cli import exclusive
from celery_exclusive.core import marks
from celery_exclusive.core.lease import acquire
from tests.support.layouts import record_layout, recorded_layout
from tests.support.workers import ROOT

HOSTNAME = socket.gethostname()


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


def test_ls_shows_each_lease_with_its_task_holder_and_token(store, held):
    result = run(store, "ls")
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    assert header.split() == [
        "KEY",
        "TASK",
        "TASK",
        "ID",
        "HOST",
        "PID",
        "ACQUIRED",
        "EXPIRES",
        "TOKEN",
        "MARKS",
    ]
    assert [row.split()[0] for row in rows] == ["exclusive:invoice:7", "exclusive:invoice:8"]
    assert rows[0].split()[1:3] == ["billing.settle", "task-7"]
    assert str(os.getpid()) in rows[0]


def test_ls_shows_times_as_people_read_them(store, held):
    row = run(store, "ls").output.splitlines()[1]
    assert re.search(r"  \d+\.\ds ago  in (29|30)\.\ds  ", row), row


def test_inspect_shows_when_the_lease_was_taken_as_local_time_not_an_epoch(store, held):
    output = run(store, "inspect", "invoice:7").output
    acquired = next(line for line in output.splitlines() if "acquired_at" in line)
    assert re.fullmatch(
        r"  acquired_at: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d \(\d+\.\ds ago\)",
        acquired,
    ), acquired
    assert "expires: in " in output


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
    assert "released exclusive:invoice:7: 1 lease, held by task task-7" in result.output
    assert backend_for_url(store).holders_of("exclusive:invoice:7") == []


def test_release_asks_naming_the_lock_that_holds_the_key_by_its_name_and_process(store):
    with ExclusiveLock("exclusive:report", store, 30, name="billing.report"):
        result = run(store, "release", "report", input="n\n")
        assert backend_for_url(store).holders_of("exclusive:report")
    lock = f"an exclusive lock of billing.report in process {os.getpid()} on {HOSTNAME}"
    assert f"Release exclusive:report, held by {lock}?" in result.output


# --- a key a foreign client holds (a ?recipe= store) ---------------------------------------


@pytest.fixture
def redis_recipe(redis_url):
    """A Redis store speaking the SET NX recipe, and redis-py on the same database."""
    return redis_url + "?recipe=set-nx", redis.Redis.from_url(redis_url)


def test_release_of_a_key_a_redis_py_lock_holds_frees_nothing_and_names_it_left_alone(
    redis_recipe,
):
    store, client = redis_recipe
    theirs = client.lock("exclusive:invoice:7", timeout=30)
    assert theirs.acquire(blocking=False)
    token = theirs.local.token.decode()
    result = run(store, "release", "invoice:7")  # nothing of ours to free: nothing asked
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "exclusive:invoice:7: nothing released",
        "exclusive:invoice:7: left alone: a client of Redis's SET NX lock recipe (redis-py "
        f"Lock, python-redis-lock, redsync...) with the value {token!r}, not taken by "
        "celery-exclusive; free it with its own client",
    ]
    assert client.get("exclusive:invoice:7") == theirs.local.token
    assert theirs.release() is None  # still theirs to release


def test_release_of_a_key_a_postgresql_session_holds_frees_nothing_and_names_it_left_alone(
    postgres_server, postgresql_url
):
    store = postgresql_url + "&recipe=advisory"
    with psycopg.connect(postgres_server.url, autocommit=True) as theirs:
        sql = "('x' || left(md5(%s), 16))::bit(64)::bigint"
        theirs.execute(f"SELECT pg_advisory_lock({sql})", ("exclusive:invoice:7",))
        pid = theirs.info.backend_pid
        result = run(store, "release", "invoice:7", "--yes")
        assert result.exit_code == 0, result.output
        assert "exclusive:invoice:7: nothing released" in result.output
        assert re.search(
            rf"left alone: a PostgreSQL session advisory lock on -?\d+ held by backend {pid} "
            r"\(user postgres.*\), not taken by celery-exclusive; free it with its own client",
            result.output,
        ), result.output
        unlocked = theirs.execute(f"SELECT pg_advisory_unlock({sql})", ("exclusive:invoice:7",))
        assert unlocked.fetchone() == (True,)  # its session held it all along


def test_watch_refreshes_the_table(store, held):
    result = run(store, "watch", "--count", "2", "--interval", "0.01")
    assert result.output.count("exclusive:invoice:7") == 2


def test_an_unreachable_store_is_a_one_line_error():
    result = run("redis://127.0.0.1:1/0", "ls")
    assert result.exit_code == 1
    assert "did not answer" in result.output and "Traceback" not in result.output


def test_the_celery_subcommand_reads_the_store_from_the_app(store, held):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.support.apps.ledger",
            "exclusive",
            "ls",
            "--json",
        ],
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


def celery_exclusive(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The standalone ``celery-exclusive`` command, as a process of its own."""
    return subprocess.run(
        [sys.executable, "-c", "from celery_exclusive.cli import main; main()", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EXCLUSIVE_BACKEND_URL": "", "PYTHONPATH": str(ROOT), **(env or {})},
    )


COMMANDS = sorted(exclusive.commands)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_shows_its_help_without_a_store(command):
    result = celery_exclusive(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: celery-exclusive {command} [OPTIONS]")
    assert "--backend" in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_celery_subcommand_shows_its_help_without_an_app(command, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "celery", "exclusive", command, "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EXCLUSIVE_BACKEND_URL": ""},
    )
    assert out.returncode == 0, out.stderr
    assert f"celery exclusive {command} [OPTIONS]" in out.stdout.splitlines()[0]


def test_the_store_may_be_named_after_the_command(store, held):
    result = CliRunner().invoke(exclusive, ["ls", "--json", "--backend", store])
    assert result.exit_code == 0, result.output
    assert [row["task_id"] for row in json.loads(result.output)] == ["task-7", "task-8"]


def test_the_prefix_may_be_named_after_the_command(store, held):
    result = CliRunner().invoke(
        exclusive,
        ["ls", "--prefix", "exclusive:invoice:8", "--json"],
        env={"EXCLUSIVE_BACKEND_URL": store},
    )
    assert [row["task_id"] for row in json.loads(result.output)] == ["task-8"]


def test_the_store_named_after_the_command_wins_over_the_one_before_it(store, held):
    unreachable = "redis://127.0.0.1:1/0"
    result = CliRunner().invoke(exclusive, ["--backend", unreachable, "ls", "--backend", store])
    assert result.exit_code == 0, result.output
    assert "exclusive:invoice:7" in result.output


def test_a_store_on_the_command_line_wins_over_the_environment(store, held):
    unreachable = "redis://127.0.0.1:1/0"
    for args in (["--backend", store, "ls"], ["ls", "--backend", store]):
        result = CliRunner().invoke(exclusive, args, env={"EXCLUSIVE_BACKEND_URL": unreachable})
        assert result.exit_code == 0, (args, result.output)
        assert "exclusive:invoice:7" in result.output


def test_the_store_named_after_a_celery_subcommand_wins_over_the_apps(store, held):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.support.apps.ledger",
            "exclusive",
            "ls",
            "--json",
            "--backend",
            store,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        # The app's own store holds nothing.
        env={**os.environ, "EXCLUSIVE_TEST_STORE": "memory://", "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert [r["task_id"] for r in json.loads(out.stdout)] == ["task-7", "task-8"]


def test_the_help_names_the_stores_environment_variable():
    result = CliRunner().invoke(exclusive, ["--help"], terminal_width=200)
    (backend,) = [line for line in result.output.splitlines() if "--backend" in line]
    assert "env var: EXCLUSIVE_BACKEND_URL" in backend


#: Keys a store accepts that would break a table: a newline, an escape sequence, a tab, a
#: key of 300 wide characters, an empty-looking line separator.
ODD_KEYS = [
    "exclusive:line\nbreak",
    "exclusive:\x1b[31mred\x1b[0m\ttab",
    "exclusive:" + "請求書" * 100,
    "exclusive:sep\u2028arator",
]


@pytest.fixture
def odd_keys_held(store):
    backend = backend_for_url(store)
    leases = [
        acquire(backend, key, 30, name="odd", task_id=f"t{i}") for i, key in enumerate(ODD_KEYS)
    ]
    yield
    for lease in leases:
        lease.release()


def test_ls_shows_one_line_per_key_whatever_the_key_holds(store, odd_keys_held):
    lines = run(store, "ls").output.splitlines()
    assert len(lines) == 1 + len(ODD_KEYS)
    shown = sorted(line.split("  ")[0].strip() for line in lines[1:])
    assert shown == sorted(
        [
            "exclusive:line\\nbreak",
            "exclusive:\\x1b[31mred\\x1b[0m\\ttab",
            "exclusive:" + "請求書" * 8 + "…",  # 59 columns: the 60th would not fit
            "exclusive:sep\\u2028arator",
        ]
    )
    assert "\x1b" not in "".join(lines)


def test_ls_json_gives_odd_keys_exactly(store, odd_keys_held):
    rows = json.loads(run(store, "ls", "--json").output)
    assert sorted(row["key"] for row in rows) == sorted(ODD_KEYS)


def test_inspect_and_release_show_an_odd_key_on_one_line(store, odd_keys_held):
    output = run(store, "inspect", ODD_KEYS[0]).output
    assert output.splitlines()[0] == "exclusive:line\\nbreak: held by 1"
    output = run(store, "release", ODD_KEYS[0], "--yes").output
    assert output == "released exclusive:line\\nbreak: 1 lease, held by task t0 on " + (
        f"{backend_for_url(store).holders_of(ODD_KEYS[1])[0].holder['hostname']}\n"
    )


def test_a_missing_client_library_is_one_line_naming_the_extra(tmp_path):
    """As on a machine where redis-py is not installed: importing it fails."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['redis'] = None\n")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from celery_exclusive.cli.commands import main; main()",
            "--backend",
            "redis://127.0.0.1:1/0",
            "ls",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert "pip install 'celery-exclusive[redis]'" in out.stderr
    assert out.stderr.startswith("Error: exclusive_backend_url uses redis://")


def test_migrate_says_a_store_without_tables_needs_nothing(store):
    result = run(store, "migrate")
    assert result.exit_code == 0, result.output
    assert ": this store needs nothing created\n" in result.output


def test_a_command_meeting_a_newer_layout_refuses_in_one_line(store):
    record_layout(store, "exclusive:", 99)
    result = run(store, "ls")
    assert result.exit_code == 1
    assert result.output.startswith("Error: the store at ")
    assert "layout version 99" in result.output and "upgrade this process" in result.output
    assert "Traceback" not in result.output


def test_a_command_that_only_reads_records_no_layout(store):
    assert run(store, "ls").exit_code == 0
    assert recorded_layout(store, "exclusive:") is None


def test_migrate_moves_an_older_layout_to_this_version(store):
    record_layout(store, "exclusive:", 0)
    assert run(store, "ls").exit_code == 1
    result = run(store, "migrate")
    assert result.exit_code == 0, result.output
    assert "recorded (the store held version 0)" in result.output
    assert recorded_layout(store, "exclusive:") == "1"
    assert run(store, "ls").exit_code == 0
