"""``celery -A proj exclusive web``: this host only unless told otherwise, and a clear
refusal of a guessable release token."""

from __future__ import annotations

import sys
import time
import urllib.request

from tests.support.servers import free_port
from tests.support.workers import LoggedProcess

APP = "tests.support.apps.web_app"


def celery(*args: str, env: dict) -> LoggedProcess:
    return LoggedProcess([sys.executable, "-m", "celery", "-A", APP, *args], env, "web-cli")


def test_the_page_is_served_on_this_host_only_by_default(sqlite_url):
    port = free_port()
    server = celery(
        "exclusive", "web", "--port", str(port), env={"EXCLUSIVE_TEST_STORE": sqlite_url}
    )
    server.ready_text = "Uvicorn running"
    with server:
        assert f"on http://127.0.0.1:{port}/ (read-only)" in server.output()
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
        assert b"celery-exclusive" in page


def test_a_short_release_token_is_refused_with_one_line(sqlite_url):
    env = {"EXCLUSIVE_TEST_STORE": sqlite_url, "EXCLUSIVE_WEB_RELEASE_TOKEN": "short"}
    process = celery("exclusive", "web", "--port", str(free_port()), env=env).start()
    deadline = time.monotonic() + 60
    while process.process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    output = process.output()
    assert process.process.returncode != 0
    assert "Error: the web view's release token has 5 characters; use at least 16" in output
    assert "Traceback" not in output


def test_the_standalone_command_serves_the_store_named_after_web(sqlite_url):
    port = free_port()
    server = LoggedProcess(
        [
            sys.executable,
            "-c",
            "from celery_exclusive.cli import main; main()",
            "web",
            "--backend",
            sqlite_url,
            "--port",
            str(port),
        ],
        {"EXCLUSIVE_BACKEND_URL": ""},
        "web-cli",
    )
    server.ready_text = "Uvicorn running"
    with server:
        assert f"celery-exclusive web: {sqlite_url} on http://127.0.0.1:{port}/" in server.output()
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
        assert b"celery-exclusive" in page
