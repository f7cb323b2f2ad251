"""Settings: the naming rule, defaults, and errors that name the setting."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_exclusive import ConfigurationError, ExclusiveTask
from celery_exclusive.core.config import resolve
from tests.support.workers import Worker


def settings_of(app_conf: dict, **task_options):
    app = Celery("settings", broker=app_conf.pop("broker_url", "memory://"), set_as_current=False)
    app.conf.update(app_conf)

    @app.task(base=ExclusiveTask, shared=False, **task_options)
    def task(x):
        pass

    return task.exclusive_settings


def test_defaults_apply_when_nothing_is_set():
    settings = settings_of({})
    assert (settings.lease_ttl, settings.limit, settings.on_duplicate) == (30.0, 1, "skip")
    assert settings.on_backend_error == "requeue"
    assert settings.key_prefix == "exclusive:"


def test_a_key_prefix_that_is_not_text_is_named():
    with pytest.raises(ConfigurationError, match="exclusive_key_prefix"):
        settings_of({"exclusive_key_prefix": "exclusive\udcff:"})


def test_an_app_setting_applies_to_every_task():
    assert settings_of({"exclusive_on_duplicate": "wait"}).on_duplicate == "wait"


def test_a_task_attribute_overrides_the_app_setting():
    settings = settings_of({"exclusive_lease_ttl": 60}, exclusive_lease_ttl=5)
    assert settings.lease_ttl == 5.0


def test_django_style_namespaced_settings_are_found():
    class DjangoSettings:
        CELERY_BROKER_URL = "memory://"
        CELERY_EXCLUSIVE_ON_DUPLICATE = "requeue"

    app = Celery("django", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")

    @app.task(base=ExclusiveTask)
    def task(x):
        pass

    assert task.exclusive_settings.on_duplicate == "requeue"


def test_a_redis_broker_is_the_default_lease_store():
    url = "redis://127.0.0.1:6399/3"
    assert settings_of({"broker_url": url}).backend_url == url


def test_other_brokers_default_to_a_sqlite_file_private_to_the_app():
    assert settings_of({"broker_url": "amqp://guest@localhost//"}).backend_url.startswith(
        "sqlite:///"
    )


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("on_duplicate", "drop", "'skip', 'requeue', 'wait', 'rerun'"),
        ("on_backend_error", "ignore", "'requeue', 'run'"),
        ("on_lease_lost", "panic", "'terminate', 'abort', 'log'"),
        ("lease_ttl", 0, "positive number of seconds"),
        ("lease_ttl", "soon", "positive number of seconds"),
        ("limit", 0, "whole number of at least 1"),
        ("backend_url", "nosuchstore://x", "redis://"),
        ("unique_for", -1, "positive number of seconds"),
        ("unique_for", float("inf"), "positive number of seconds"),
        ("unique_after", "always", "'success', 'end'"),
        ("debounce", -1, "positive number of seconds"),
        ("debounce", "soon", "positive number of seconds"),
        ("rate", "fast", "runs per period: '10/m'"),
        ("rate", "0/m", "runs per period: '10/m'"),
    ],
)
def test_a_bad_value_names_the_setting_and_the_allowed_values(name, value, allowed):
    with pytest.raises(ConfigurationError) as info:
        resolve("billing.settle", {name: value}.get, lambda name: None)
    message = str(info.value)
    assert "billing.settle" in message
    assert f"exclusive_{name}={value!r}" in message
    assert allowed in message


def test_a_worker_with_a_bad_setting_refuses_to_start_and_says_why():
    worker = Worker(
        "tests.support.apps.ledger", {"EXCLUSIVE_TEST_ON_DUPLICATE": "drop"}, pool="solo"
    )
    worker.start(wait=False)
    assert worker.process.wait(60) != 0
    output = worker.output()
    assert "exclusive_on_duplicate='drop' is not allowed" in output
    assert "'skip', 'requeue', 'wait', 'rerun'" in output
    assert "Traceback" not in output


def test_a_misspelt_task_setting_is_refused_with_the_likely_name():
    with pytest.raises(ConfigurationError) as info:
        settings_of({}, exclusive_lease_tll=5)
    assert "exclusive_lease_tll is not a celery-exclusive setting" in str(info.value)
    assert "did you mean exclusive_lease_ttl?" in str(info.value)


def test_every_setting_is_a_task_attribute_defaulting_to_the_app_setting():
    from celery_exclusive.core.config import NAMES

    assert all(getattr(ExclusiveTask, f"exclusive_{name}") is None for name in NAMES)


def test_the_default_store_is_named_after_the_app_and_the_user(monkeypatch, tmp_path):
    import os

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    url = settings_of({"broker_url": "amqp://guest@localhost//"}).backend_url
    assert url == f"sqlite:///{tmp_path}/celery-exclusive/settings-uid{os.getuid()}.sqlite3"


def test_a_tasks_rate_sets_its_limit_over_an_app_wide_limit():
    settings = resolve("api.call", {"rate": "5/m"}.get, {"limit": 2}.get)
    assert (settings.rate, settings.limit) == ("5/m", 5)


def test_a_tasks_own_limit_beside_its_rate_is_refused_naming_both():
    with pytest.raises(ConfigurationError, match="exclusive_limit=2.*exclusive_rate='5/m'"):
        resolve("api.call", {"rate": "5/m", "limit": 2}.get, lambda name: None)


def test_a_rate_that_is_no_text_is_named():
    with pytest.raises(ConfigurationError, match=r"exclusive_rate=\['10/m'\]"):
        resolve("api.call", {"rate": ["10/m"]}.get, lambda name: None)


def test_a_debounce_max_wait_without_a_debounce_is_refused():
    with pytest.raises(ConfigurationError, match="exclusive_debounce_max_wait=60.*debounce"):
        resolve("search.reindex", {"debounce_max_wait": 60}.get, lambda name: None)


def test_a_debounce_under_enqueue_scope_is_refused_naming_both():
    with pytest.raises(ConfigurationError, match="exclusive_scope='both'.*exclusive_debounce=5"):
        resolve("search.reindex", {"debounce": 5, "scope": "both"}.get, lambda name: None)


def test_a_debounce_under_rerun_is_refused_naming_both():
    with pytest.raises(ConfigurationError, match="exclusive_on_duplicate='rerun'.*debounce=5"):
        resolve("search.reindex", {"debounce": 5, "on_duplicate": "rerun"}.get, lambda n: None)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"on_lease_lost": "log"}, "exclusive_on_lease_lost='log'"),
        ({"limit": 2}, "exclusive_limit=2"),
        ({"unique_for": 60}, "exclusive_unique_for=60"),
        ({"debounce": 5}, "exclusive_debounce=5"),
        ({"priority": True}, "exclusive_priority=True"),
    ],
)
def test_replace_with_an_option_that_keeps_the_newest_call_from_running_is_refused(given, named):
    options = {"on_duplicate": "replace", **given}
    with pytest.raises(ConfigurationError, match=named.replace("(", r"\(")):
        resolve("search.preview", options.get, lambda name: None)
