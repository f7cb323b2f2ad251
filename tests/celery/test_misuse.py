"""Options and settings that would do nothing are refused, naming the task or the setting
as the user wrote it, and the fix: when the task is defined, at the latest when a worker
or beat starts."""

from __future__ import annotations

import logging
import sys

import pytest
from celery import Celery, Task, current_app

from celery_exclusive import ConfigurationError, ExclusiveTask
from celery_exclusive.beat.scheduler import beat_settings
from celery_exclusive.celery.checks import check_app
from tests.support.workers import LoggedProcess, Worker


@pytest.fixture(autouse=True)
def outside_the_celery_program(monkeypatch):
    """Tests here are a producer's process: under the ``celery`` program (whose module
    another test in this process may have imported) a class is not refused as it is made,
    but by the worker's start-up check."""
    monkeypatch.delitem(sys.modules, "celery.bin.celery", raising=False)


def app_of(**conf) -> Celery:
    app = Celery("billing", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return app


def define(app: Celery, **options):
    """Define ``billing.settle`` with ``options``, as ``@app.task`` does; the class is
    made (and checked) here."""

    def settle(invoice_id, note=None):
        return invoice_id

    task = app.task(name="billing.settle", shared=False, **options)(settle)
    return task._get_current_object() if hasattr(task, "_get_current_object") else task


def refusal(app: Celery, **options) -> str:
    with pytest.raises(ConfigurationError) as refused:
        define(app, **options)
    return str(refused.value)


# --- a forgotten base class ----------------------------------------------------------


def test_exclusive_options_on_a_plain_task_are_refused_naming_the_base_class():
    app = app_of()
    define(app, exclusive_key="invoice:{invoice_id}")
    with pytest.raises(ConfigurationError) as refused:
        check_app(app)
    message = str(refused.value)
    assert message.startswith("billing.settle: exclusive_key='invoice:{invoice_id}' is set")
    assert "not an ExclusiveTask" in message and "base=ExclusiveTask" in message


def test_a_producers_first_send_of_a_plain_task_with_exclusive_options_logs_the_fix(caplog):
    # Celery's signals cannot stop a send: the producer is told, once, before a worker
    # (which refuses to start) is ever reached.
    previous = current_app._get_current_object()
    app = Celery("billing", broker="memory://")
    try:
        task = define(app, exclusive_key="invoice:{invoice_id}")
        with caplog.at_level(logging.ERROR, "celery_exclusive"):
            task.delay(7)
            task.delay(8)
    finally:
        previous.set_current()
    [said] = [r.getMessage() for r in caplog.records if "not an ExclusiveTask" in r.getMessage()]
    assert "billing.settle: exclusive_key='invoice:{invoice_id}' is set" in said
    assert "base=ExclusiveTask" in said


def test_exclusive_options_on_a_plain_class_based_task_are_refused():
    app = app_of()

    class Settle(Task):
        name = "billing.settle"
        exclusive_on_duplicate = "wait"

        def run(self, invoice_id):
            return invoice_id

    app.register_task(Settle())
    with pytest.raises(ConfigurationError, match="exclusive_on_duplicate='wait' is set"):
        check_app(app)


def test_a_worker_refuses_a_task_with_exclusive_options_but_no_exclusive_base():
    """The app module never imports celery-exclusive: the ``celery`` program does."""
    output = refused_start("worker", "forgotten_base")
    assert "billing.settle: exclusive_key='invoice:{invoice_id}' is set" in output
    assert "base=ExclusiveTask" in output


# --- options of another library, or spelt otherwise ------------------------------------


def test_a_leftover_celery_once_option_is_refused_when_the_task_is_defined():
    message = refusal(
        app_of(),
        base=ExclusiveTask,
        once={"keys": ["invoice_id"], "graceful": True, "timeout": 60},
    )
    assert message.startswith("billing.settle: once={'keys': ['invoice_id']")
    assert "celery-once's option" in message
    assert "exclusive_key=['invoice_id']" in message
    assert "exclusive_scope='both'" in message
    assert "exclusive_enqueue_ttl=60" in message


@pytest.mark.parametrize(
    "option, value, translation",
    [
        ("unique_on", "invoice_id", "exclusive_key=['invoice_id']"),
        ("unique_on", [], "exclusive_key=[]"),
        ("lock_expiry", 600, "exclusive_enqueue_ttl=600"),
        ("raise_on_duplicate", True, "exclusive_scope='enqueue'"),
        ("singleton_backend_url", "redis://r/1", "exclusive_backend_url='redis://r/1'"),
    ],
)
def test_a_leftover_celery_singleton_option_is_refused_with_its_translation(
    option, value, translation
):
    message = refusal(app_of(), base=ExclusiveTask, **{option: value})
    assert f"billing.settle: {option}={value!r} is celery-singleton's option" in message
    assert translation in message


def test_a_setting_spelt_without_its_prefix_is_refused_with_the_task_spelling():
    message = refusal(app_of(), base=ExclusiveTask, on_duplicate="wait")
    assert "billing.settle: on_duplicate='wait' is not read" in message
    assert "write exclusive_on_duplicate='wait'" in message


def test_a_misspelt_task_option_is_refused_when_the_task_is_defined():
    message = refusal(app_of(), base=ExclusiveTask, exclusive_lease_tll=5)
    assert "exclusive_lease_tll is not a celery-exclusive setting" in message
    assert "did you mean exclusive_lease_ttl?" in message


def test_every_mistake_of_a_task_is_named_at_once():
    message = refusal(app_of(), base=ExclusiveTask, unique_on="invoice_id", limit=2)
    assert message.startswith("2 problems:")
    assert "unique_on='invoice_id'" in message and "write exclusive_limit=2" in message


def test_celerys_own_options_stay_allowed_on_an_exclusive_task():
    task = define(app_of(), base=ExclusiveTask, priority=5, exclusive_key=["invoice_id"])
    assert task.priority == 5


def test_a_peer_option_read_by_a_base_class_of_the_users_stays_allowed():
    class Audited(Task):
        lock_expiry = None  # this base reads it

    class ExclusiveAudited(ExclusiveTask, Audited):
        pass

    assert define(app_of(), base=ExclusiveAudited, lock_expiry=60).lock_expiry == 60


def test_a_worker_refuses_a_leftover_option_in_one_line():
    output = refused_start("worker", "leftover_once")
    assert "billing.settle: once={'keys': ['invoice_id']} is celery-once's option" in output


# --- settings nobody reads -------------------------------------------------------------


def test_a_misspelt_app_setting_is_refused_with_the_likely_name():
    app = app_of(exclusive_lease_tll=60)
    with pytest.raises(ConfigurationError) as refused:
        check_app(app)
    assert str(refused.value) == (
        "exclusive_lease_tll is not a celery-exclusive setting; did you mean exclusive_lease_ttl?"
    )


def test_a_misspelt_app_setting_is_refused_at_the_first_call_of_a_producer():
    app = app_of(exclusive_lease_tll=60, task_always_eager=True)
    task = define(app, base=ExclusiveTask)
    with pytest.raises(ConfigurationError, match="did you mean exclusive_lease_ttl"):
        task.delay(7)


def test_an_uppercase_app_setting_is_refused_naming_the_lowercase_one():
    app = app_of(EXCLUSIVE_LEASE_TTL=60)
    with pytest.raises(ConfigurationError) as refused:
        check_app(app)
    assert "EXCLUSIVE_LEASE_TTL is never read" in str(refused.value)
    assert "write exclusive_lease_ttl" in str(refused.value)


class DjangoSettings:
    CELERY_BROKER_URL = "memory://"
    CELERY_EXCLUSIVE_LEASE_TLL = 60
    CELERY_EXCLUSIVE_ON_DUPLICATE = "drop"


def django_app(namespace=None) -> Celery:
    app = Celery("billing", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace=namespace)
    return app


def test_a_misspelt_django_setting_is_refused_in_the_django_spelling():
    with pytest.raises(ConfigurationError) as refused:
        check_app(django_app("CELERY"))
    assert (
        "CELERY_EXCLUSIVE_LEASE_TLL is not a celery-exclusive setting; did you mean "
        "CELERY_EXCLUSIVE_LEASE_TTL?"
    ) in str(refused.value)


def test_a_bad_django_setting_is_named_as_the_user_wrote_it():
    app = django_app("CELERY")
    del DjangoSettings.CELERY_EXCLUSIVE_LEASE_TLL
    try:
        task = define(app, base=ExclusiveTask)
        with pytest.raises(ConfigurationError) as refused:
            _ = task.exclusive_settings
        assert "CELERY_EXCLUSIVE_ON_DUPLICATE='drop' is not allowed" in str(refused.value)
        with pytest.raises(ConfigurationError) as refused:
            beat_settings(app)
        assert "CELERY_EXCLUSIVE_ON_DUPLICATE='drop' is not allowed" in str(refused.value)
    finally:
        DjangoSettings.CELERY_EXCLUSIVE_LEASE_TLL = 60


def test_django_settings_of_an_app_without_the_namespace_are_refused_naming_it():
    with pytest.raises(ConfigurationError) as refused:
        check_app(django_app())
    message = str(refused.value)
    assert "CELERY_EXCLUSIVE_ON_DUPLICATE is never read" in message
    assert "namespace='CELERY'" in message


def test_a_leftover_setting_of_another_library_is_refused_with_its_translation():
    app = app_of(ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": "redis://r/2"}})
    define(app, base=ExclusiveTask)
    with pytest.raises(ConfigurationError) as refused:
        check_app(app)
    assert "ONCE is celery-once's setting" in str(refused.value)
    assert "exclusive_backend_url='redis://r/2'" in str(refused.value)


def test_a_worker_refuses_a_misspelt_setting_with_the_likely_name():
    output = refused_start("worker", "misspelt_setting")
    assert "did you mean exclusive_lease_ttl?" in output


def test_a_worker_refuses_django_settings_it_would_never_read():
    output = refused_start("worker", "django_unread")
    assert "CELERY_EXCLUSIVE_ON_DUPLICATE is never read" in output


def test_a_worker_refuses_a_setting_of_a_library_no_task_uses():
    output = refused_start("worker", "leftover_settings")
    assert "singleton_lock_expiry is celery-singleton's setting" in output
    assert "exclusive_enqueue_ttl=600" in output


def test_beat_refuses_a_misspelt_setting_with_the_likely_name(tmp_path):
    output = refused_start("beat", "misspelt_setting", "-s", str(tmp_path / "schedule"))
    assert "did you mean exclusive_lease_ttl?" in output


def refused_start(command: str, case: str, *extra: str) -> str:
    """Start ``celery <command>`` on the misuse app's ``case``; it must exit at once
    with one line saying what to fix."""
    args = [sys.executable, "-m", "celery", "-A", "tests.support.apps.misuse:app", command]
    if command == "worker":
        process: LoggedProcess = Worker("tests.support.apps.misuse:app", {}, pool="solo")
    else:
        process = LoggedProcess([*args, "-l", "INFO", *extra], {}, f"misuse-{command}")
    process.env["MISUSE_CASE"] = case
    process.start(wait=False)
    try:
        assert process.process.wait(60) != 0, process.output()
    finally:
        process.stop()
    output = process.output()
    assert "celery-exclusive: ConfigurationError: " in output, output
    assert "Traceback" not in output, output
    assert "ready." not in output
    return output


# --- per call ----------------------------------------------------------------------


def test_a_setting_given_to_one_call_is_refused():
    task = define(app_of(task_always_eager=True), base=ExclusiveTask)
    with pytest.raises(ConfigurationError) as refused:
        task.apply_async((7,), exclusive_on_duplicate="wait")
    assert "billing.settle.apply_async(exclusive_on_duplicate='wait')" in str(refused.value)
    assert "a call cannot change them" in str(refused.value)


def test_celery_onces_per_call_option_is_refused_with_its_translation():
    task = define(app_of(task_always_eager=True), base=ExclusiveTask)
    with pytest.raises(ConfigurationError) as refused:
        task.apply_async((7,), once={"graceful": True})
    assert "celery-once's per-call option" in str(refused.value)
    assert "exclusive_scope='both'" in str(refused.value)
