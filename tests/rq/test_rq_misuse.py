"""``@exclusive`` and RQ workers refuse what nothing would read: RQ's own job options,
a Celery task's spelling, celery-once and celery-singleton leftovers, and ``EXCLUSIVE_*``
environment variables that look like settings but are never read."""

from __future__ import annotations

import pytest

from celery_exclusive import ConfigurationError
from celery_exclusive.rq import exclusive
from celery_exclusive.rq.checks import check_environment
from tests.support.apps import rq_jobs
from tests.support.workers import RQWorker


@pytest.mark.parametrize(
    "option, value, where",
    [
        ("unique", True, "queue.enqueue(f, ..., job_id=..., unique=True)"),
        ("job_timeout", 60, "queue.enqueue(f, ..., job_timeout=...)"),
        ("timeout", 60, "RQ's @job(timeout=...)"),
        ("result_ttl", 500, "queue.enqueue(f, ..., result_ttl=...)"),
        ("retry", 3, "queue.enqueue(f, ..., retry=Retry(...))"),
    ],
)
def test_an_option_of_rqs_own_is_refused_saying_where_it_goes(option, value, where):
    with pytest.raises(ConfigurationError) as refused:
        exclusive(**{option: value})(rq_jobs.plain)
    message = str(refused.value)
    assert f"@exclusive({option}={value!r}) is RQ's own job option" in message
    assert where in message


def test_a_celery_task_spelling_is_refused_with_the_decorators_one():
    with pytest.raises(ConfigurationError) as refused:
        exclusive(exclusive_on_duplicate="wait")(rq_jobs.plain)
    assert "is a Celery task's spelling" in str(refused.value)
    assert "@exclusive(on_duplicate='wait')" in str(refused.value)


@pytest.mark.parametrize(
    "option, value, translation",
    [
        ("once", {"keys": ["key"]}, "@exclusive(key=['key'])"),
        ("unique_on", "key", "@exclusive(key=['key'])"),
        ("lock_expiry", 60, "queue.enqueue(f, ..., ttl=60)"),
    ],
)
def test_a_leftover_option_of_another_library_is_refused_with_its_translation(
    option, value, translation
):
    with pytest.raises(ConfigurationError) as refused:
        exclusive(**{option: value})(rq_jobs.plain)
    assert "option, which nothing reads here" in str(refused.value)
    assert translation in str(refused.value)
    assert "scope=" not in str(refused.value)  # a setting RQ does not have


@pytest.mark.parametrize(
    "variable, says",
    [
        ("EXCLUSIVE_LEASE_TLL", "did you mean EXCLUSIVE_LEASE_TTL?"),
        ("EXCLUSIVE_ONDUPLICATE", "did you mean EXCLUSIVE_ON_DUPLICATE?"),
        ("EXCLUSIVE_KEY", "a key is never read from the environment"),
        ("EXCLUSIVE_SCOPE", "a Celery setting that RQ never reads"),
        ("EXCLUSIVE_SKIP_STATE", "a Celery setting that RQ never reads"),
        ("EXCLUSIVE_BEAT_LEASE_TTL", "exclusive_beat_lease_ttl"),
    ],
)
def test_an_environment_variable_nothing_reads_is_refused(variable, says):
    with pytest.raises(ConfigurationError) as refused:
        check_environment({variable: "1"})
    assert str(refused.value).startswith(f"{variable} is ")
    assert says in str(refused.value)


def test_environment_variables_of_other_names_and_real_settings_are_left_alone():
    check_environment(
        {
            "EXCLUSIVE_LEASE_TTL": "60",
            "EXCLUSIVE_BACKEND_URL": "redis://",
            "EXCLUSIVE_TEST_ON_DUPLICATE": "wait",  # another variable, not a typo
            "EXCLUSIVE_MY_FLAG": "1",
        }
    )


def test_an_rq_worker_with_a_misspelt_setting_refuses_to_start(redis_url):
    worker = RQWorker(redis_url, "misuse", "misuse", env={"EXCLUSIVE_LEASE_TLL": "60"})
    worker.start(wait=False)
    try:
        assert worker.process.wait(60) != 0
    finally:
        worker.stop()
    output = worker.output()
    assert "EXCLUSIVE_LEASE_TLL is not a celery-exclusive setting" in output
    assert "did you mean EXCLUSIVE_LEASE_TTL?" in output
    assert "Listening on" not in output
