"""The web view in a real browser (Debian's Chromium, driven by Playwright) against a
real ``celery worker`` holding real leases in Redis.

A screenshot of the page is kept in ``$ARTIFACTS_DIR`` (default ``tests/.artifacts``),
whose path the test prints.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import redis

from celery_exclusive import ExclusiveLock, LeaseLost
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.heartbeat import heartbeat
from celery_exclusive.core.lease import acquire
from tests.support.servers import free_port
from tests.support.workers import ROOT, Worker

playwright = pytest.importorskip("playwright.sync_api")
uvicorn = pytest.importorskip("uvicorn")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN = "browser-test-release-token-0123456789"
HOSTNAME = socket.gethostname()

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="apt-get install chromium")


class Served:
    """The web view served by uvicorn in a thread of this process."""

    def __init__(self, app) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack(redis_server):
    from tests.conftest import fresh_redis_db

    broker, store = fresh_redis_db(redis_server), fresh_redis_db(redis_server)
    env = {"EXCLUSIVE_TEST_BROKER": broker, "EXCLUSIVE_TEST_STORE": store}
    worker = Worker("tests.support.apps.web_app", env, concurrency=4, name="web").start()
    yield store, Tasks(broker), worker
    worker.stop()


class Tasks:
    """The worker's tasks, sent by a client app of this module's own (a Celery app keeps
    the broker it first connected to)."""

    def __init__(self, broker: str) -> None:
        from celery import Celery

        self.client = Celery("web-browser-client", broker=broker, backend=broker)
        self.hold = self._task("web.hold")
        self.hold_or_requeue = self._task("web.hold_or_requeue")

    def _task(self, name: str):
        class Sender:
            @staticmethod
            def delay(*args):
                return self.client.send_task(name, args)

        return Sender


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def served(stack):
    from celery_exclusive.web import create_app

    store = stack[0]
    releasing = Served(create_app(store, release_token=TOKEN, refresh=0.3))
    with releasing, Served(create_app(store, refresh=0.3)) as read_only:
        yield releasing, read_only


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1500, "height": 900})
    page = context.new_page()
    dialogs: list = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.dialogs = dialogs
    yield page
    context.close()


def row(page, key: str):
    return page.locator(f'tr[data-key="{key}"]')


def artifacts() -> Path:
    folder = Path(os.environ.get("ARTIFACTS_DIR") or ROOT / "tests" / ".artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_count_of_held_keys_is_in_words(browser, page, sqlite_url):
    from celery_exclusive.web import create_app

    lease = acquire(backend_for_url(sqlite_url), "exclusive:invoice:7", 30, name="settle")
    try:
        with Served(create_app(sqlite_url, refresh=0.3)) as served:
            page.goto(served.url)
            row(page, "exclusive:invoice:7").wait_for(timeout=15_000)
            assert page.locator("#held-count").inner_text() == "(1 key)"
    finally:
        lease.release()


def test_the_page_shows_the_workers_leases_and_drops_them_when_they_end(stack, served, page):
    _, web_app, _ = stack
    results = [web_app.hold.delay(n, 4.0) for n in (1, 2)]
    page.goto(served[0].url)
    for n in (1, 2):
        first = row(page, f"exclusive:job:{n}")
        first.wait_for(timeout=20_000)
        cells = first.locator("td").all_inner_texts()
        assert cells[1] == "web.hold"
        assert cells[2] in {r.id for r in results}
        assert cells[4].isdigit()  # the worker's pool process
    assert [r.get(timeout=30) for r in results] == ["held 1", "held 2"]
    # No reload: the stream drops them.
    row(page, "exclusive:job:1").wait_for(state="detached", timeout=10_000)
    row(page, "exclusive:job:2").wait_for(state="detached", timeout=10_000)


def test_duplicates_skipped_on_the_worker_appear_in_the_feed(stack, served, page):
    _, web_app, _ = stack
    page.goto(served[0].url)
    first = web_app.hold.delay(3, 3.0)
    row(page, "exclusive:job:3").wait_for(timeout=20_000)
    assert web_app.hold.delay(3, 0).get(timeout=20)["outcome"] == "skipped"
    event = page.locator('#feed li[data-kind="skipped"]', has_text="exclusive:job:3")
    event.wait_for(timeout=15_000)
    assert first.id in event.inner_text()
    first.get(timeout=20)


def test_hostile_keys_are_shown_as_text_never_run(stack, served, page):
    store = stack[0]
    backend = backend_for_url(store)
    key = "exclusive:<img src=x onerror=alert(1)>\"'\n\x00" + "z" * 3000
    lease = acquire(backend, key, 30, name="<script>alert(2)</script>", task_id="t\"'<b>")
    try:
        page.goto(served[0].url)
        page.locator("td.key", has_text="<img src=x").wait_for(timeout=15_000)
        assert page.locator("#leases img, #leases script, #leases b").count() == 0
        shown = page.locator("td.key", has_text="<img src=x").inner_text()
        assert shown.startswith("exclusive:<img src=x onerror=alert(1)>\"'\\n\\x00zzz")
        assert shown.endswith("…")
        assert page.get_by_text("<script>alert(2)</script>").count() == 1
        time.sleep(1)
        assert page.dialogs == []
    finally:
        lease.release()


def test_a_release_with_the_token_frees_a_workers_lease_and_its_loss_is_reported(
    stack, served, page
):
    store, web_app, _ = stack
    stuck = web_app.hold.delay(5, 60.0)
    page.goto(served[0].url)
    held = row(page, "exclusive:job:5")
    held.wait_for(timeout=20_000)

    held.get_by_role("button", name="Release…").click()
    assert "exclusive:job:5" in page.locator("#confirm-key").inner_text()
    page.fill("#token", "not-the-token-0000000000")
    page.click("#do-release")
    page.locator("#confirm-error", has_text="wrong release token").wait_for(timeout=10_000)
    assert backend_for_url(store).holders_of("exclusive:job:5")

    [released] = backend_for_url(store).holders_of("exclusive:job:5")
    page.fill("#token", TOKEN)
    page.screenshot(path=str(artifacts() / "web-view-release-dialog.png"))
    page.click("#do-release")
    held.wait_for(state="detached", timeout=10_000)
    # That lease is gone (the call it stopped is sent again, and may hold the key anew).
    holders = backend_for_url(store).holders_of("exclusive:job:5")
    assert released.owner not in [info.owner for info in holders]
    page.locator('#feed li[data-kind="released"]', has_text="exclusive:job:5").wait_for(
        timeout=10_000
    )
    # The worker finds its lease gone at its next renewal, and says so in the feed.
    page.locator('#feed li[data-kind="lost"]', has_text="exclusive:job:5").wait_for(timeout=20_000)
    stuck.forget()


def test_the_release_dialog_names_a_lock_by_its_name_and_process_and_stops_nobody(
    stack, served, page
):
    store = stack[0]
    lease = ExclusiveLock("exclusive:report:21", store, 30, name="billing.report").acquire()
    holder = f"an exclusive lock of billing.report in process {os.getpid()} on {HOSTNAME}"
    try:
        page.goto(served[0].url)
        held = row(page, "exclusive:report:21")
        held.wait_for(timeout=20_000)
        held.get_by_role("button", name="Release…").click()
        shown = page.locator("#confirm-holders").inner_text()
        assert shown == f"{holder}, fencing token {lease.fencing_token}"
        note = page.locator("#confirm-note").inner_text()
        assert "stops nobody" in note and "is stopped" not in note
        page.fill("#token", TOKEN)
        page.click("#do-release")
        held.wait_for(state="detached", timeout=10_000)
        event = page.locator('#feed li[data-kind="released"]', has_text="exclusive:report:21")
        event.wait_for(timeout=10_000)
        assert f"held by {holder}" in event.inner_text()
        # The lock finds its lease gone at its next renewal, and says whose it was.
        heartbeat().beat()
        with pytest.raises(LeaseLost) as lost:
            lease.ensure_held()
        assert str(lost.value).startswith(
            f"billing.report in process {os.getpid()} on {HOSTNAME} lost its lease"
        )
    finally:
        lease.release()


def test_without_the_token_the_page_is_read_only(stack, served, page):
    store, web_app, _ = stack
    running = web_app.hold.delay(6, 5.0)
    page.goto(served[1].url)
    held = row(page, "exclusive:job:6")
    held.wait_for(timeout=20_000)
    assert page.locator("#mode").inner_text() == "read-only"
    assert page.locator("button.release").count() == 0
    status = page.evaluate(
        """async (token) => (await fetch("api/release", {method: "POST",
            headers: {"content-type": "application/json", "x-release-token": token},
            body: JSON.stringify({key: "exclusive:job:6", tokens: []})})).status""",
        TOKEN,
    )
    assert status in (404, 405)
    assert backend_for_url(store).holders_of("exclusive:job:6")
    running.get(timeout=20)


def test_a_screenshot_of_the_live_page_is_kept(stack, served, page):
    store, web_app, _ = stack
    backend = backend_for_url(store)
    results = [web_app.hold.delay(n, 6.0) for n in (7, 8)]
    results.append(web_app.hold_or_requeue.delay(7, 0))
    lease = acquire(backend, "exclusive:report:<b>quarterly</b>\n", 30, limit=2, name="r")
    page.goto(served[0].url)
    row(page, "exclusive:job:8").wait_for(timeout=20_000)
    page.locator('#feed li[data-kind="requeued"]').wait_for(timeout=20_000)
    path = artifacts() / "web-view.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"\nscreenshot of the web view: {path}")
    assert path.stat().st_size > 10_000
    lease.release()
    for result in results[:2]:
        result.get(timeout=30)
    shutil.copy(path, artifacts() / "web-view-latest.png")


# --- a key a foreign client holds (?recipe=set-nx) -------------------------------------------


@pytest.fixture(scope="module")
def recipe_stack(redis_server):
    """A worker whose store takes Redis's SET NX lock recipe, and the page of that store."""
    from celery_exclusive.web import create_app
    from tests.conftest import fresh_redis_db

    broker, store = fresh_redis_db(redis_server), fresh_redis_db(redis_server) + "?recipe=set-nx"
    env = {"EXCLUSIVE_TEST_BROKER": broker, "EXCLUSIVE_TEST_STORE": store}
    worker = Worker("tests.support.apps.web_app", env, name="web-recipe").start()
    with Served(create_app(store, refresh=0.3)) as served:
        yield redis.Redis.from_url(store.partition("?")[0]), Tasks(broker), served
    worker.stop()


def test_a_duplicate_skipped_for_a_redis_py_lock_is_shown_in_the_feed_naming_it(recipe_stack, page):
    client, tasks, served = recipe_stack
    theirs = client.lock("exclusive:job:20", timeout=30)
    assert theirs.acquire(blocking=False)
    token = theirs.local.token.decode()
    try:
        page.goto(served.url)
        assert tasks.hold.delay(20, 0).get(timeout=20)["outcome"] == "skipped"
        event = page.locator('#feed li[data-kind="skipped"]', has_text="exclusive:job:20")
        event.wait_for(timeout=15_000)
        shown = event.inner_text()
    finally:
        theirs.release()
    assert (
        "held by a client of Redis's SET NX lock recipe (redis-py Lock, python-redis-lock, "
        f"redsync...) with the value {token!r}, not taken by "
        "celery-exclusive"
    ) in shown
