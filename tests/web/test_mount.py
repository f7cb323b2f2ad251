"""The web view mounted inside an application of the user's, behind its authentication:
a FastAPI app, and a Django project served over ASGI. Real uvicorn servers, real
requests."""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx
import pytest

from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.lease import acquire
from tests.support.servers import free_port
from tests.support.workers import LoggedProcess

uvicorn = pytest.importorskip("uvicorn")
fastapi = pytest.importorskip("fastapi")

TOKEN = "mounted-release-token-0123456789"


@pytest.fixture
def held(sqlite_url):
    lease = acquire(backend_for_url(sqlite_url), "exclusive:invoice:7", 30, name="t", task_id="t-7")
    yield lease
    lease.release()


def serve_in_thread(app):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def fastapi_app(store: str):
    """A user's FastAPI app: its own authentication middleware sets the user, and the
    web view refuses whoever it did not authenticate."""
    from starlette.authentication import (
        AuthCredentials,
        AuthenticationBackend,
        SimpleUser,
    )
    from starlette.middleware.authentication import AuthenticationMiddleware

    from celery_exclusive.web import create_app

    class Tokens(AuthenticationBackend):
        async def authenticate(self, conn):
            if conn.headers.get("authorization") == "Bearer ana-token":
                return AuthCredentials(["ops"]), SimpleUser("ana")
            return None

    api = fastapi.FastAPI()

    @api.get("/health")
    def health():
        return {"ok": True}

    def signed_in(request):
        return request.user.display_name if request.user.is_authenticated else None

    api.mount("/ops/locks", create_app(store, release_token=TOKEN, identify=signed_in))
    api.add_middleware(AuthenticationMiddleware, backend=Tokens())
    return api


def test_mounted_in_fastapi_it_serves_only_whom_the_app_authenticated(sqlite_url, held, caplog):
    server, thread, url = serve_in_thread(fastapi_app(sqlite_url))
    ana = {"authorization": "Bearer ana-token"}
    try:
        assert httpx.get(f"{url}/health").json() == {"ok": True}
        assert httpx.get(f"{url}/ops/locks/").status_code == 403
        assert httpx.get(f"{url}/ops/locks/api/page").status_code == 403
        moved = httpx.get(f"{url}/ops/locks", headers=ana)
        assert moved.status_code in (307, 308)
        assert moved.headers["location"].endswith("/ops/locks/")
        page = httpx.get(f"{url}/ops/locks/", headers=ana)
        assert page.status_code == 200 and 'src="static/app.js"' in page.text
        assert httpx.get(f"{url}/ops/locks/static/app.js", headers=ana).status_code == 200
        keys = httpx.get(f"{url}/ops/locks/api/page", headers=ana).json()["page"]["keys"]
        assert [row["key"] for row in keys] == ["exclusive:invoice:7"]
        assert httpx.get(f"{url}/ops/locks/api/config", headers=ana).json()["who"] == "ana"
        with httpx.stream("GET", f"{url}/ops/locks/api/stream", headers=ana) as stream:
            data = next(line for line in stream.iter_lines() if line.startswith("data: "))
        assert json.loads(data[6:])["page"]["keys"][0]["key"] == "exclusive:invoice:7"
        released = httpx.post(
            f"{url}/ops/locks/api/release",
            json={"key": "exclusive:invoice:7", "tokens": [held.fencing_token]},
            headers={**ana, "x-release-token": TOKEN},
        )
        assert released.status_code == 200, released.text
        assert "for ana" in caplog.text
    finally:
        server.should_exit = True
        thread.join(10)


def test_mounted_in_a_django_project_it_serves_its_signed_in_staff_only(sqlite_url, held, tmp_path):
    port = free_port()
    env = {
        "EXCLUSIVE_TEST_STORE": sqlite_url,
        "EXCLUSIVE_TEST_DB": str(tmp_path / "django.db"),
        "EXCLUSIVE_TEST_TOKEN": TOKEN,
    }
    args = [sys.executable, "-m", "uvicorn", "tests.support.django_web.asgi:application"]
    server = LoggedProcess([*args, "--port", str(port)], env, "django-web")
    server.ready_text = "Uvicorn running"
    url = f"http://127.0.0.1:{port}"
    with server:
        assert httpx.get(f"{url}/").text == "the project's own page"
        assert httpx.get(f"{url}/ops/locks/api/page").status_code == 403
        with httpx.Client(base_url=url) as bob:
            assert bob.post("/login/", data={"username": "bob", "password": "bob-password"})
            assert bob.get("/ops/locks/api/page").status_code == 403  # not staff
        with httpx.Client(base_url=url) as ana:
            wrong = ana.post("/login/", data={"username": "ana", "password": "guess"})
            assert wrong.status_code == 401
            assert ana.get("/ops/locks/api/page").status_code == 403
            assert ana.post("/login/", data={"username": "ana", "password": "ana-password"})
            keys = ana.get("/ops/locks/api/page").json()["page"]["keys"]
            assert [row["key"] for row in keys] == ["exclusive:invoice:7"]
            assert ana.get("/ops/locks/api/config").json()["who"] == "ana"
            assert ana.get("/ops/locks/").status_code == 200
            released = ana.post(
                "/ops/locks/api/release",
                json={"key": "exclusive:invoice:7", "tokens": [held.fencing_token]},
                headers={"x-release-token": TOKEN},
            )
            assert released.status_code == 200, released.text
        assert "for ana" in server.output()
