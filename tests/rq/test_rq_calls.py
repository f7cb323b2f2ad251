"""``@exclusive`` in the calling process: direct calls, synchronous queues, options.

A marked function never runs without its lease. Called directly it takes the lease
itself; as the function of an RQ job that is not an ``ExclusiveJob`` it refuses. The
decorator's options are the settings of ``config.Settings``, and errors name them as
an RQ user gave them.
"""

from __future__ import annotations

import inspect
import pickle
import uuid

import pytest
import redis
from rq import Queue
from rq.job import Job

from celery_exclusive import ConfigurationError, DuplicateSkipped, LayoutMismatch, backend_for_url
from celery_exclusive.core import config
from celery_exclusive.rq import ExclusiveJob, exclusive
from celery_exclusive.rq.options import resolve
from tests.support.apps import rq_jobs
from tests.support.layouts import record_layout


@pytest.fixture
def store(redis_url, monkeypatch):
    """A Redis lease store named by EXCLUSIVE_BACKEND_URL, as a process's environment does."""
    monkeypatch.setenv("EXCLUSIVE_BACKEND_URL", redis_url)
    return backend_for_url(redis_url)


def held(store, key: str):
    """Take ``key`` as some other holder would."""
    return store.try_acquire("exclusive:" + key, uuid.uuid4().hex, 30, 1, {"task_id": "other"})


# --- direct calls -----------------------------------------------------------------


def test_a_direct_call_runs_under_a_lease_it_takes_itself(store):
    ran = rq_jobs.fenced("direct")
    assert ran["lease"] == "HeldLease" and isinstance(ran["token"], int)
    assert store.holders_of("exclusive:direct") == []


def test_a_direct_call_of_a_held_key_is_skipped(store):
    held(store, "direct-held")
    with pytest.raises(DuplicateSkipped) as info:
        rq_jobs.fenced("direct-held")
    assert (info.value.key, info.value.holder_task_id) == ("exclusive:direct-held", "other")


def test_a_direct_call_with_no_store_to_use_is_refused_naming_backend_url(monkeypatch):
    monkeypatch.delenv("EXCLUSIVE_BACKEND_URL", raising=False)
    with pytest.raises(ConfigurationError, match="EXCLUSIVE_BACKEND_URL") as info:
        rq_jobs.fenced("nowhere")
    assert "tests.support.apps.rq_jobs.fenced" in str(info.value)


# --- synchronous queues -------------------------------------------------------------


def sync_queue(url: str, **options) -> Queue:
    return Queue(uuid.uuid4().hex, connection=redis.Redis.from_url(url), is_async=False, **options)


def test_a_synchronous_queue_without_the_job_class_refuses_a_marked_function(redis_url):
    job = sync_queue(redis_url).enqueue(rq_jobs.fenced, "sync")
    assert job.get_status() == "failed"
    error = job.latest_result().exc_string
    assert "ConfigurationError" in error and "job_class=ExclusiveJob" in error


def test_a_synchronous_queue_with_the_job_class_runs_a_marked_function_under_its_lease(
    redis_url,
):
    job = sync_queue(redis_url, job_class=ExclusiveJob).enqueue(rq_jobs.fenced, "sync")
    assert job.get_status() == "finished"
    assert job.return_value()["lease"] == "HeldLease"


def test_an_async_marked_function_runs_under_the_lease_of_its_job(redis_url):
    job = sync_queue(redis_url, job_class=ExclusiveJob).enqueue(rq_jobs.fenced_async, "async")
    assert job.get_status() == "finished"
    assert job.return_value()["lease"] == "HeldLease"


def test_a_synchronous_queue_skips_a_duplicate_as_a_worker_does(redis_url):
    held(backend_for_url(redis_url), "sync-held")
    job = sync_queue(redis_url, job_class=ExclusiveJob).enqueue(rq_jobs.fenced, "sync-held")
    assert job.get_status() == "canceled"
    assert job.return_value()["outcome"] == "skipped"


# --- what RQ sees of a marked function -------------------------------------------------


def test_a_marked_function_keeps_its_dotted_name_for_rq(redis_url):
    job = Job.create(rq_jobs.fenced, args=("k",), connection=redis.Redis.from_url(redis_url))
    assert job.func_name == "tests.support.apps.rq_jobs.fenced"
    assert job.func is rq_jobs.fenced
    assert pickle.loads(pickle.dumps(rq_jobs.fenced)) is rq_jobs.fenced


# --- options and settings ------------------------------------------------------------


def test_the_decorator_takes_every_setting_but_those_of_celery_only():
    options = set(inspect.signature(exclusive).parameters) - {"function"}
    assert options == set(config.NAMES) - {"scope", "enqueue_ttl", "skip_state"}


def test_an_unknown_option_is_refused_naming_the_one_meant():
    with pytest.raises(ConfigurationError, match=r"did you mean @exclusive\(on_duplicate=\.\.\.\)"):
        exclusive(on_dupe="skip")(rq_jobs.plain)


def test_an_option_of_celerys_apply_async_is_refused_saying_what_rq_offers():
    with pytest.raises(ConfigurationError, match="apply_async only.*unique=True"):
        exclusive(scope="enqueue")(rq_jobs.plain)


def test_skip_state_is_refused_since_a_skipped_job_always_ends_canceled():
    with pytest.raises(ConfigurationError, match="always ends canceled.*never counts as failed"):
        exclusive(skip_state="failure")(rq_jobs.plain)


def test_a_bad_option_is_named_as_the_decorator_argument():
    with pytest.raises(ConfigurationError, match=r"@exclusive\(on_duplicate='sometimes'\)"):
        exclusive(on_duplicate="sometimes")(rq_jobs.plain)


def test_a_bad_environment_setting_is_named_as_its_variable(monkeypatch):
    monkeypatch.setenv("EXCLUSIVE_ON_DUPLICATE", "sometimes")
    with pytest.raises(ConfigurationError, match="EXCLUSIVE_ON_DUPLICATE='sometimes'"):
        exclusive()(rq_jobs.plain)


@pytest.mark.parametrize(
    "raw, value",
    [("true", True), ("1", True), ("Yes", True), ("false", False), ("0", False), ("NO", False)],
)
def test_environment_booleans_parse(monkeypatch, raw, value):
    monkeypatch.setenv("EXCLUSIVE_PRIORITY", raw)
    exclusive()(rq_jobs.plain)  # the import-time check of a module of marked functions
    assert resolve("t", {}, "redis://localhost").priority is value


def test_an_environment_boolean_that_is_none_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("EXCLUSIVE_PRIORITY", "maybe")
    with pytest.raises(ConfigurationError, match="EXCLUSIVE_PRIORITY='maybe' is not allowed"):
        exclusive()(rq_jobs.plain)


def test_a_direct_call_meeting_a_newer_layout_is_refused_naming_the_upgrade(redis_url, monkeypatch):
    prefix = f"v{uuid.uuid4().hex[:8]}:"  # a prefix this process has not met yet
    monkeypatch.setenv("EXCLUSIVE_BACKEND_URL", redis_url)
    monkeypatch.setenv("EXCLUSIVE_KEY_PREFIX", prefix)
    record_layout(redis_url, prefix, 99)
    with pytest.raises(LayoutMismatch, match="layout version 99.*upgrade this process"):
        rq_jobs.fenced("newer")
    assert backend_for_url(redis_url).holders(prefix) == []
