"""The pytest plugin users test their own tasks with (celery_exclusive.testing), run the
way users run it: pytest in a subprocess on small test files, the plugin loaded from
its entry point."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest_plugins = ("pytester",)

#: A user's app in eager mode, with a Redis broker that no server answers: a test that
#: reached for Redis would fail with BackendUnavailable.
EAGER_APP = """
    import pytest
    from celery import Celery
    from celery_exclusive import DuplicateSkipped, ExclusiveTask

    app = Celery("proj", broker="redis://127.0.0.1:9/0", set_as_current=False)
    app.conf.task_always_eager = True

    @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}")
    def settle(invoice_id):
        return f"settled {invoice_id}"
"""


def run_user_tests(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_user=textwrap.dedent(EAGER_APP) + textwrap.dedent(source))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", *args)


def test_an_eager_call_uses_the_private_store_not_the_redis_broker(pytester):
    result = run_user_tests(
        pytester,
        """
        def test_settle(exclusive_store):
            assert settle.delay(7).get() == "settled 7"
            assert settle.exclusive_settings.backend_url == exclusive_store.url
        """,
    )
    result.assert_outcomes(passed=1)


def test_a_held_key_gives_the_duplicate_what_a_worker_would(pytester):
    result = run_user_tests(
        pytester,
        """
        def test_a_duplicate_is_skipped(exclusive_store):
            with exclusive_store.hold(settle, 7, task_id="other-worker"):
                with pytest.raises(DuplicateSkipped) as info:
                    settle.delay(7).get()
            assert info.value.holder_task_id == "other-worker"
            assert settle.delay(7).get() == "settled 7"  # released at the end of the block

        def test_another_key_is_free(exclusive_store):
            with exclusive_store.hold(settle, 7):
                assert settle.delay(8).get() == "settled 8"
        """,
    )
    result.assert_outcomes(passed=2)


def test_each_test_starts_with_an_empty_store(pytester):
    result = run_user_tests(
        pytester,
        """
        from celery_exclusive.core.lease import acquire

        def test_leaves_a_key_held(exclusive_store):
            acquire(exclusive_store.backend, "exclusive:invoice:7", 60, task_id="leaked")

        def test_finds_it_free(exclusive_store):
            assert exclusive_store.holders(settle, 7) == []
            assert settle.delay(7).get() == "settled 7"
        """,
    )
    result.assert_outcomes(passed=2)


def test_a_setting_changed_after_another_test_used_the_task_is_seen(pytester):
    result = run_user_tests(
        pytester,
        """
        def test_uses_the_task_first(exclusive_store):
            assert settle.delay(7).get() == "settled 7"

        def test_then_changes_a_setting(exclusive_store, monkeypatch):
            monkeypatch.setitem(app.conf, "exclusive_skip_state", "success")
            with exclusive_store.hold(settle, 7, task_id="other-worker"):
                assert settle.delay(7).get() == {
                    "outcome": "skipped", "key": "exclusive:invoice:7", "holder": "other-worker"
                }

        def test_and_the_change_is_undone_after_it(exclusive_store):
            with exclusive_store.hold(settle, 7):
                with pytest.raises(DuplicateSkipped):
                    settle.delay(7).get()

        def test_a_task_attribute_changed_later_is_seen_too(exclusive_store, monkeypatch):
            monkeypatch.setattr(settle, "exclusive_skip_state", "success")
            with exclusive_store.hold(settle, 7):
                assert settle.delay(7).get()["outcome"] == "skipped"
        """,
    )
    result.assert_outcomes(passed=4)


def test_an_app_setting_a_fixture_makes_after_first_use_is_seen(pytester):
    """Without the plugin's store: a user's own fixture pointing the app at a store."""
    result = run_user_tests(
        pytester,
        """
        import uuid

        @pytest.fixture
        def own_store(monkeypatch):
            url = f"memory://{uuid.uuid4().hex}"
            monkeypatch.setitem(app.conf, "exclusive_backend_url", url)
            return url

        @pytest.mark.parametrize("n", range(3))
        def test_settle(own_store, n):
            assert settle.exclusive_settings.backend_url == own_store
            assert settle.delay(7).get() == "settled 7"
        """,
    )
    result.assert_outcomes(passed=3)


#: A user's tests on celery.contrib.pytest's in-process worker (a thread of the test
#: process, non-eager: duplicates really are requeued through the broker).
WORKER_TESTS = """
    import time

    import pytest
    from celery_exclusive import DuplicateSkipped, ExclusiveTask

    @pytest.fixture
    def settle(exclusive_store, celery_app, celery_worker):
        @celery_app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}",
                         exclusive_requeue_delay=0.05, exclusive_requeue_max_delay=0.2)
        def settle(invoice_id):
            return f"settled {invoice_id}"

        celery_worker.reload()
        return settle

    def test_a_worker_skips_a_duplicate_of_a_held_key(exclusive_store, settle):
        with exclusive_store.hold(settle, 7, task_id="other-worker"):
            with pytest.raises(DuplicateSkipped) as info:
                settle.delay(7).get(timeout=60)
        assert info.value.holder_task_id == "other-worker"
        assert settle.delay(7).get(timeout=60) == "settled 7"

    def test_a_worker_requeues_until_the_key_is_free(exclusive_store, settle):
        settle.exclusive_on_duplicate = "requeue"
        with exclusive_store.hold(settle, 7):
            result = settle.delay(7)
            time.sleep(0.5)
            assert not result.ready()
        assert result.get(timeout=60) == "settled 7"
"""


def test_the_store_works_with_celery_contrib_pytest_worker(pytester):
    pytester.makepyfile(test_worker=textwrap.dedent(WORKER_TESTS))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "celery.contrib.pytest", "-v"
    )
    result.assert_outcomes(passed=2)


def test_the_plugin_can_be_turned_off(pytester):
    pytester.makepyfile(
        test_off="""
        def test_uses_it(exclusive_store):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:celery_exclusive")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'exclusive_store' not found*"])


# --- with pytest-celery installed -------------------------------------------------------


@pytest.fixture(scope="module")
def pytest_celery_site(tmp_path_factory):
    """pytest-celery and what it needs beyond this environment, installed into a folder
    of its own: put on PYTHONPATH, it is installed for one run only."""
    site = tmp_path_factory.mktemp("pytest-celery-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            str(site),
            "pytest-celery>=1.0",
            "pytest-docker-tools>=3.1.3",
            "docker>=7.1",
            "tenacity>=9.0",
            "debugpy>=1.8",
            "psutil>=5.9",
        ],
        check=True,
        timeout=300,
    )
    return site


def run_with_pytest_celery(pytester, site, *args: str) -> pytest.RunResult:
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    pytester._monkeypatch.setenv("PYTHONPATH", pythonpath)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", *args)


def test_with_pytest_celery_its_plugin_replaces_celerys_worker_fixture(
    pytester, pytest_celery_site
):
    """What the README warns about: pytest-celery's ``celery_worker`` needs Docker."""
    pytester.makepyfile(
        test_which="""
        import pytest_celery

        def test_which_celery_worker(request):
            fixture = request._fixturemanager.getfixturedefs("celery_worker", request.node)[-1]
            print("celery_worker from", fixture.func.__module__)
        """
    )
    result = run_with_pytest_celery(pytester, pytest_celery_site, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*celery_worker from pytest_celery.*"])


def test_with_pytest_celery_installed_the_in_process_worker_is_chosen_with_p_flags(
    pytester, pytest_celery_site
):
    pytester.makepyfile(test_worker=textwrap.dedent(WORKER_TESTS))
    result = run_with_pytest_celery(
        pytester, pytest_celery_site, "-p", "no:celery", "-p", "celery.contrib.pytest"
    )
    result.assert_outcomes(passed=2)


def test_with_pytest_celery_installed_eager_tests_and_its_session_worker_work(
    pytester, pytest_celery_site
):
    pytester.makepyfile(
        test_session=textwrap.dedent(EAGER_APP)
        + textwrap.dedent(
            """
            def test_eager(exclusive_store):
                with exclusive_store.hold(settle, 7):
                    with pytest.raises(DuplicateSkipped):
                        settle.delay(7).get()

            def test_session_worker(exclusive_store, celery_session_app, celery_session_worker):
                @celery_session_app.task(base=ExclusiveTask, exclusive_key="k:{n}")
                def mark(n):
                    return n

                celery_session_worker.reload()
                with exclusive_store.hold(mark, 1):
                    with pytest.raises(DuplicateSkipped):
                        mark.delay(1).get(timeout=60)
                assert mark.delay(1).get(timeout=60) == 1
            """
        )
    )
    result = run_with_pytest_celery(pytester, pytest_celery_site)
    result.assert_outcomes(passed=2)
