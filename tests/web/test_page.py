"""The web view's application: what it serves, what it refuses, and how it releases.

Against real stores (Redis and SQLite) holding real leases, through Starlette's test
client; the page itself in a browser is tests/web/test_browser.py.
"""

from __future__ import annotations

import json
import logging

import pytest
import redis
from starlette.testclient import TestClient

from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.feed import append_events
from celery_exclusive.core.lease import acquire
from celery_exclusive.errors import ExclusiveError
from celery_exclusive.web import create_app

TOKEN = "a-release-token-of-32-characters"
HOSTILE = ["<script>alert(1)</script>", "quote'\"s", "new\nline", "nul\x00byte", "long" * 500]


@pytest.fixture(params=["redis", "sqlite"])
def store(request):
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def held(store):
    """Real leases, renewed by this process's heartbeat while the test runs."""
    backend = backend_for_url(store)
    leases = [
        acquire(backend, "exclusive:invoice:7", 30, name="billing.settle", task_id="task-7"),
        *[
            acquire(backend, "exclusive:sem", 30, limit=3, name="s", task_id=f"s-{i}")
            for i in (1, 2)
        ],
    ]
    yield leases
    for lease in leases:
        lease.release()


def client(store: str, **options) -> TestClient:
    return TestClient(create_app(store, **options))


def snapshot(web: TestClient, **params) -> dict:
    answer = web.get("/api/page", params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_page_is_served_with_its_script_and_style(store):
    web = client(store)
    page = web.get("/")
    assert page.status_code == 200
    assert 'src="static/app.js"' in page.text
    assert web.get("/static/app.js").status_code == 200
    assert web.get("/static/style.css").status_code == 200


def test_the_page_shows_each_held_key_with_its_holders_and_slots(store, held):
    keys = {row["key"]: row for row in snapshot(client(store))["page"]["keys"]}
    assert sorted(keys) == ["exclusive:invoice:7", "exclusive:sem"]
    [lease] = keys["exclusive:invoice:7"]["leases"]
    assert lease["task"] == "billing.settle"
    assert lease["task_id"] == "task-7"
    assert lease["fencing_token"] == held[0].fencing_token
    assert 0 < lease["expires_in"] <= 30
    assert 0 <= lease["renewed_ago"] < 30
    assert keys["exclusive:sem"]["limit"] == 3
    assert sorted(x["task_id"] for x in keys["exclusive:sem"]["leases"]) == ["s-1", "s-2"]


def test_the_page_never_shows_an_owner_token(store, held):
    text = client(store).get("/api/page").text
    assert all(lease.grant.owner not in text for lease in held)


def test_the_page_shows_waiters_in_line_and_the_pending_rerun(store, held):
    backend = backend_for_url(store)
    now = backend.store_time()
    line = [{"id": "w-1", "until": now + 30, "priority": True}, {"id": "w-2", "until": now + 30}]
    backend.swap_mark("exclusive:invoice:7", "line", None, json.dumps(line), 30)
    backend.swap_mark("exclusive:invoice:7", "rerun", None, json.dumps({"task_id": "r-9"}), 30)
    keys = {row["key"]: row for row in snapshot(client(store))["page"]["keys"]}
    row = keys["exclusive:invoice:7"]
    assert [(w["id"], w["priority"]) for w in row["line"]] == [("w-1", True), ("w-2", False)]
    assert row["rerun"] == "r-9"


def test_the_filter_narrows_the_keys_under_the_prefix(store, held):
    keys = snapshot(client(store), filter="inv")["page"]["keys"]
    assert [row["key"] for row in keys] == ["exclusive:invoice:7"]


def test_pages_follow_their_cursor_to_the_last(store):
    backend = backend_for_url(store)
    leases = [acquire(backend, f"exclusive:k{i:03d}", 30, name="t") for i in range(25)]
    try:
        web, cursor, seen = client(store, page_size=10), None, []
        for _ in range(20):
            page = snapshot(web, **({"cursor": cursor} if cursor else {}))["page"]
            seen += [row["key"] for row in page["keys"]]
            cursor = page["cursor"]
            if cursor is None:
                break
        assert sorted(set(seen)) == [f"exclusive:k{i:03d}" for i in range(25)]
    finally:
        for lease in leases:
            lease.release()


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_keys_come_back_exactly_as_json_data(store, hostile):
    lease = acquire(backend_for_url(store), "exclusive:" + hostile, 30, name="t")
    try:
        [row] = snapshot(client(store))["page"]["keys"]
        assert row["key"] == "exclusive:" + hostile
    finally:
        lease.release()


def test_the_stream_pushes_snapshots_with_each_feed_event_once(store, held):
    backend = backend_for_url(store)
    event = {"id": "e-1", "at": 1.0, "kind": "skipped", "key": "exclusive:invoice:7"}
    append_events(backend, "exclusive:", [json.dumps(event)], 100, 60)
    web = client(store, refresh=0.2)
    snapshots = []
    with web.stream("GET", "/api/stream") as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: "):
                snapshots.append(json.loads(line[len("data: ") :]))
            if len(snapshots) == 3:
                break
    assert [s["feed"]["events"] for s in snapshots] == [[event], [], []]
    assert all(len(s["page"]["keys"]) == 2 for s in snapshots)


def test_a_store_that_does_not_answer_is_shown_not_raised():
    web = client("redis://127.0.0.1:1/0")
    body = snapshot(web)
    assert "did not answer" in body["page"]["error"]


# --- read-only unless started with a token -------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("path", ["/api/release", "/api/page", "/", "/api/config"])
def test_without_a_token_no_request_changes_anything(store, held, method, path):
    web = client(store)
    answer = web.request(method, path, json={"key": "exclusive:invoice:7", "tokens": []})
    assert answer.status_code in (404, 405)
    assert len(snapshot(web)["page"]["keys"]) == 2
    assert web.get("/api/config").json()["release"] is False


def release(web: TestClient, key: str, tokens: list, token: str = TOKEN, **headers):
    return web.post(
        "/api/release",
        json={"key": key, "tokens": tokens},
        headers={"x-release-token": token, **headers},
    )


def test_a_release_with_the_token_frees_the_key_and_logs_who(store, held, caplog):
    web = client(store, release_token=TOKEN)
    with caplog.at_level(logging.WARNING, "celery_exclusive.web"):
        answer = release(web, "exclusive:invoice:7", [held[0].fencing_token])
    assert answer.status_code == 200, answer.text
    assert answer.json()["released"] == 1
    assert [row["key"] for row in snapshot(web)["page"]["keys"]] == ["exclusive:sem"]
    assert "released key='exclusive:invoice:7' (1 lease; held by task task-7" in caplog.text
    assert "for testclient:" in caplog.text
    [event] = [e for e in snapshot(web)["feed"]["events"] if e["kind"] == "released"]
    assert event["key"] == "exclusive:invoice:7"


def test_a_release_of_a_key_a_redis_py_lock_holds_frees_nothing_and_names_it(redis_url):
    store, direct = redis_url + "?recipe=set-nx", redis.Redis.from_url(redis_url)
    theirs = direct.lock("exclusive:invoice:7", timeout=30)
    assert theirs.acquire(blocking=False)
    token = theirs.local.token
    web = client(store, release_token=TOKEN)
    answer = release(web, "exclusive:invoice:7", [])  # the page confirms none of ours
    assert answer.status_code == 200, answer.text
    foreign = (
        "a client of Redis's SET NX lock recipe (redis-py Lock, python-redis-lock, redsync...) "
        f"with the value {token.decode()!r}, not taken by celery-exclusive"
    )
    assert answer.json() == {"released": 0, "key": "exclusive:invoice:7", "left_alone": [foreign]}
    assert direct.get("exclusive:invoice:7") == token
    [event] = [e for e in snapshot(web)["feed"]["events"] if e["kind"] == "released"]
    assert (event["count"], event["holder"], event["left_alone"]) == (0, None, foreign)
    theirs.release()


def test_a_release_with_a_wrong_token_is_refused(store, held):
    web = client(store, release_token=TOKEN)
    answer = release(web, "exclusive:invoice:7", [held[0].fencing_token], token="x" * 32)
    assert answer.status_code == 403
    assert len(snapshot(web)["page"]["keys"]) == 2


def test_a_release_from_another_site_is_refused(store, held):
    web = client(store, release_token=TOKEN)
    tokens = [held[0].fencing_token]
    answer = release(web, "exclusive:invoice:7", tokens, **{"sec-fetch-site": "cross-site"})
    assert answer.status_code == 403
    form = web.post(
        "/api/release",
        data={"key": "exclusive:invoice:7", "tokens": "1"},
        headers={"x-release-token": TOKEN},
    )
    assert form.status_code == 415
    assert len(snapshot(web)["page"]["keys"]) == 2


def test_a_release_of_holders_other_than_those_confirmed_is_refused(store, held):
    web = client(store, release_token=TOKEN)
    answer = release(web, "exclusive:invoice:7", [held[0].fencing_token + 1])
    assert answer.status_code == 409
    assert len(snapshot(web)["page"]["keys"]) == 2


def test_a_release_outside_the_key_prefix_is_refused(store):
    lease = acquire(backend_for_url(store), "other:k", 30, name="t")
    try:
        answer = release(client(store, release_token=TOKEN), "other:k", [lease.fencing_token])
        assert answer.status_code == 400
        assert backend_for_url(store).holders_of("other:k")
    finally:
        lease.release()


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_hostile_key_is_released_exactly(store, hostile):
    key = "exclusive:" + hostile
    lease = acquire(backend_for_url(store), key, 30, name="t")
    answer = release(client(store, release_token=TOKEN), key, [lease.fencing_token])
    assert answer.status_code == 200, answer.text
    assert backend_for_url(store).holders_of(key) == []
    assert lease.lost or not lease.release()


def test_a_short_release_token_is_refused_at_start(store):
    with pytest.raises(ExclusiveError, match="at least 16"):
        create_app(store, release_token="secret")


# --- the application it is mounted in decides who may look ----------------------------------


def test_identify_refuses_whom_it_does_not_name(store):
    web = client(store, identify=lambda request: request.headers.get("x-user"))
    assert web.get("/api/page").status_code == 403
    assert web.get("/", headers={"x-user": "ana"}).status_code == 200


def test_every_answer_forbids_framing_sniffing_and_foreign_scripts(store):
    answer = client(store).get("/")
    policy = answer.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert answer.headers["x-content-type-options"] == "nosniff"
