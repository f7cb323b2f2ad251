"""ExclusiveTask changes nothing Celery does beyond exclusion: real workers, real Redis.

Each test uses a Celery feature the way a plain task would and checks, from the
ledger the worker writes, that it still happens under ExclusiveTask.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from celery import Celery
from celery.states import READY_STATES

from celery_exclusive import DuplicateSkipped
from tests.conftest import fresh_redis_db
from tests.support.apps import compat
from tests.support.cluster import Stack, wait_until
from tests.support.workers import ROOT, Worker, overlaps, read_ledger


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    configure_client(stack)
    workers = [
        Worker("tests.support.apps.compat", stack.env(), name=f"compat{i}") for i in range(2)
    ]
    stack.workers = [worker.start() for worker in workers]
    yield stack
    for worker in stack.workers:
        worker.stop()


def configure_client(stack: Stack) -> None:
    compat.app.conf.update(
        broker_url=stack.broker, result_backend=stack.broker, exclusive_backend_url=stack.store
    )


def read(cluster: Stack, kind: str) -> list[dict]:
    return [json.loads(raw) for raw in cluster.ledger.lrange(kind, 0, -1)]


@pytest.fixture
def cluster(stack):
    stack.reset()
    stack.ledger.delete("errbacks", "callbacks", "fallbacks", "nodes", "requests", "caught")
    return stack


# --- arguments --------------------------------------------------------------------


def test_a_task_called_with_bytes_runs_under_a_key_of_its_bytes(cluster):
    results = [compat.hold_bytes.delay(payload, 0.2) for payload in (b"\x00\xff", b"\x00\xff")]
    other = compat.hold_bytes.delay(b"\x00\xfe", 0.2)
    keys = [result.get(timeout=20) for result in results]
    assert keys[0] == keys[1] != other.get(timeout=20)
    assert 'bytes("\\u0000\\u00ff")' in keys[0]
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 3
    assert overlaps(entries) == []


def test_a_callback_receives_bytes_from_its_parent(cluster):
    (compat.reverse.s(b"\x00ab") | compat.echo.s("chained")).delay().get(timeout=20)
    assert [c["label"] for c in read(cluster, "callbacks")] == ["chained"]
    assert read(cluster, "callbacks")[0]["value"] == "ba\x00"


def test_a_call_with_wrong_arguments_fails_with_celerys_type_error(cluster):
    with pytest.raises(TypeError):
        compat.add(5)
    result = compat.add.delay(5)
    with pytest.raises(TypeError, match="missing"):
        result.get(timeout=20)
    assert result.state == "FAILURE"
    with pytest.raises(TypeError, match="unexpected keyword"):
        compat.add.delay(5, 5, wrong_arg=5).get(timeout=20)


# --- errbacks ---------------------------------------------------------------------


def test_a_new_style_errback_runs_under_its_lease(cluster):
    result = compat.fail.apply_async(("a",), link_error=compat.on_error.s())
    with pytest.raises(ValueError):
        result.get(timeout=20)
    assert wait_until(lambda: read(cluster, "errbacks"), timeout=10)
    [errback] = read(cluster, "errbacks")
    assert errback["failed_task_id"] == result.id
    assert errback["exc"] == "failed: a"
    assert errback["key"].startswith("exclusive:tests.support.apps.compat.on_error:")


def test_a_new_style_errback_with_stored_arguments_runs(cluster):
    result = compat.fail.apply_async(("b",), link_error=compat.on_error.s(label=b"\x01"))
    with pytest.raises(ValueError):
        result.get(timeout=20)
    assert wait_until(lambda: read(cluster, "errbacks"), timeout=10)
    [errback] = read(cluster, "errbacks")
    assert (errback["failed_task_id"], errback["label"]) == (result.id, repr(b"\x01"))


# --- results ----------------------------------------------------------------------

#: Reads a result as a client without celery-exclusive does: importing it fails.
CLIENT_WITHOUT_THE_LIBRARY = """
import json, sys
sys.modules["celery_exclusive"] = None
from celery import Celery
from celery.states import READY_STATES
app = Celery(broker=sys.argv[1], backend=sys.argv[1])
app.conf.update(result_serializer=sys.argv[2], result_accept_content=["json", "pickle"])
result = app.AsyncResult(sys.argv[3])
try:
    result.get(timeout=20)
except Exception as exc:
    kind = type(exc)
    print(json.dumps({"type": f"{kind.__module__}.{kind.__qualname__}", "text": str(exc),
                      "state": result.state, "key": getattr(exc, "key", None)}))
"""


@pytest.fixture(scope="module")
def pickle_worker(stack, redis_server):
    """A worker storing results with pickle, on a broker of its own: one app does not
    mix two result serializers (its main process reads results the other wrote)."""
    broker = fresh_redis_db(redis_server)
    env = {**stack.env(result_serializer="pickle"), "EXCLUSIVE_TEST_BROKER": broker}
    with Worker("tests.support.apps.compat", env, name="pickled"):
        yield broker


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_client_without_the_library_reads_a_skipped_duplicate(cluster, serializer, request):
    broker = request.getfixturevalue("pickle_worker") if serializer == "pickle" else cluster.broker
    # A client reading results stored with this serializer (and only those: a client
    # expecting JSON cannot decode a pickled result).
    reader = Celery(broker=broker, backend=broker, set_as_current=False)
    reader.conf.update(result_serializer=serializer, result_accept_content=["json", "pickle"])
    name = compat.hold_skip.name
    holder = reader.send_task(name, ("shared", 2.0))
    assert wait_until(lambda: cluster.holders("shared"), timeout=15)
    duplicate = reader.send_task(name, ("shared", 0))
    skipped = stored_result(reader, duplicate.id)
    assert isinstance(skipped, DuplicateSkipped)
    assert (skipped.key, skipped.holder_task_id) == ("exclusive:shared", holder.id)
    read = subprocess.run(
        [
            sys.executable,
            "-c",
            CLIENT_WITHOUT_THE_LIBRARY,
            broker,
            serializer,
            duplicate.id,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    seen = json.loads(read.stdout)
    assert seen["state"] == "FAILURE"
    assert "'exclusive:shared'" in seen["text"] and holder.id in seen["text"]
    if serializer == "pickle":
        assert (seen["type"], seen["key"]) == ("builtins.Exception", "exclusive:shared")
    else:  # Celery makes up an Exception subclass of the same name
        assert seen["type"] == "celery.exceptions.DuplicateSkipped"
    assert stored_result(reader, holder.id)["task_id"] == holder.id


def stored_result(app: Celery, task_id: str):
    """The task's result once it is ready, read from the backend (no result subscription
    left behind to outlive the test's Redis)."""
    meta = wait_until(
        lambda: (meta := app.backend.get_task_meta(task_id))["status"] in READY_STATES and meta,
        timeout=20,
    )
    return meta["result"]


# --- retries ----------------------------------------------------------------------


def test_a_body_that_catches_max_retries_exceeded_keeps_its_lease(cluster):
    result = compat.fall_back.delay("fallback", 2.0)
    assert wait_until(lambda: read(cluster, "fallbacks"), timeout=15)
    assert cluster.holders("fallback"), "the key was given up for a retry never sent"
    with pytest.raises(DuplicateSkipped):
        compat.hold_skip.delay("fallback", 0).get(timeout=60)
    assert result.get(timeout=20)["task_id"] == result.id  # ensure_held() did not raise
    assert [e["task_id"] for e in read_ledger(cluster.ledger)] == [result.id]


def test_a_body_going_on_after_retry_without_throw_keeps_its_lease(cluster):
    result = compat.retry_later.delay("throwless", 2.0)
    assert wait_until(lambda: read(cluster, "fallbacks"), timeout=15)
    assert cluster.holders("throwless")
    with pytest.raises(DuplicateSkipped):
        compat.hold_skip.delay("throwless", 0).get(timeout=60)
    assert wait_until(lambda: len(read_ledger(cluster.ledger)) == 2, timeout=20)
    first, retried = read_ledger(cluster.ledger)
    assert first["task_id"] == retried["task_id"] == result.id
    assert overlaps([first, retried]) == []


def test_ensure_held_raises_once_the_lease_went_with_a_sent_retry(cluster):
    compat.retry_caught.delay("caught")
    assert wait_until(lambda: read(cluster, "caught"), timeout=15)
    assert read(cluster, "caught")[0]["held"] is False


# --- direct calls from inside a task ------------------------------------------------


def test_a_direct_call_of_a_held_key_waits_on_its_own_and_never_requeues_its_caller(cluster):
    holder = compat.sync_node.delay("a", [], 2.0)
    assert wait_until(lambda: cluster.holders("node:a"), timeout=15)
    root = compat.sync_node.delay("root", ["a"])
    assert root.get(timeout=30) == {"a": {}}
    nodes = read(cluster, "nodes")
    assert [n["name"] for n in nodes].count("root") == 1, "the caller was requeued"
    [direct] = [n for n in nodes if n["name"] == "a" and n["task_id"] != holder.id]
    assert direct["task_id"] is None  # a call of its own, not the caller's message
    holder.get(timeout=60)
    assert not logged(cluster, f"duplicate requeued key=exclusive:node:a task_id={root.id}")


def test_a_direct_call_on_the_key_its_caller_holds_is_re_entrant(cluster):
    assert compat.sync_node.delay("self", ["self"]).get(timeout=20) == {"self": {}}
    outer, inner = read(cluster, "nodes")
    assert outer["token"] == inner["token"]
    assert cluster.holders("node:self") == []


# --- the user's own base class -------------------------------------------------------

BOTH_ORDERS = pytest.mark.parametrize(
    "task",
    [compat.audited_exclusive_first, compat.audited_audited_first],
    ids=["ExclusiveTask-first", "user-base-first"],
)


@BOTH_ORDERS
def test_the_users_request_hooks_run(cluster, task):
    result = task.delay("audited", 0)
    result.get(timeout=20)
    assert wait_until(lambda: read(cluster, "requests"), timeout=10)
    assert [(r["hook"], r["task_id"]) for r in read(cluster, "requests")] == [
        ("on_accepted", result.id)
    ]


@pytest.mark.parametrize(
    "task",
    [compat.audited_exclusive_first, compat.audited_audited_first, compat.with_throws],
    ids=["ExclusiveTask-first", "user-base-first", "throws-option"],
)
def test_the_users_throws_and_ours_are_both_expected_outcomes(cluster, task):
    holder = task.delay(f"throws-{task.name}", 1.0)
    assert wait_until(lambda: cluster.holders(f"throws-{task.name}"), timeout=15)
    duplicate = task.delay(f"throws-{task.name}", 0)
    with pytest.raises(DuplicateSkipped):
        duplicate.get(timeout=60)
    holder.get(timeout=60)
    failed = task.delay(f"throws-{task.name}", 0, True)
    with pytest.raises(compat.ExpectedError):
        failed.get(timeout=60)
    for outcome in (
        f"{duplicate.id}] raised expected: DuplicateSkipped",
        f"{failed.id}] raised expected: ExpectedError",
    ):
        assert wait_until(lambda line=outcome: logged(cluster, line), timeout=5), outcome


def logged(cluster: Stack, text: str) -> bool:
    return any(text in worker.output() for worker in cluster.workers)


# --- a killed child ------------------------------------------------------------------
#
# Last in the module: tests that kill a pool child. Celery's prefork pool can leave a
# task it received just after a child's SIGKILL unrun for a long while, so no test of
# other behaviour runs on these workers after them.


@BOTH_ORDERS
def test_our_request_frees_the_lease_of_a_killed_child(cluster, task):
    result = task.delay("audited-killed", 30)
    assert wait_until(lambda: cluster.holders("audited-killed"), timeout=15)
    [info] = cluster.holders("audited-killed")
    os.kill(info.holder["pid"], signal.SIGKILL)
    # Well before its lease_ttl of 20 s: the worker's main process freed it.
    assert wait_until(lambda: not cluster.holders("audited-killed"), timeout=12)
    with pytest.raises(Exception, match="WorkerLost|SIGKILL|exited"):
        result.get(timeout=60)
    assert ("on_failure", result.id) in [
        (r["hook"], r["task_id"]) for r in read(cluster, "requests")
    ]


# --- revoke ---------------------------------------------------------------------


@pytest.mark.parametrize("signame", ["SIGKILL", "SIGTERM"])
def test_revoke_with_terminate_frees_the_lease_at_once(cluster, signame):
    key = f"revoked-{signame}"
    result = compat.hold_long_lease.delay(key, 30)
    assert wait_until(lambda: cluster.holders(key), timeout=15)
    revoked_at = time.monotonic()
    compat.app.control.revoke(result.id, terminate=True, signal=signame)
    assert wait_until(lambda: not cluster.holders(key), timeout=10)
    freed_after = time.monotonic() - revoked_at
    assert freed_after < 5.0, f"freed after {freed_after:.2f}s (lease_ttl is 20 s)"
    assert compat.hold_skip.delay(key, 0).get(timeout=60)["token"] > 0
