"""What the built wheel carries: type information, the pytest plugin's entry point, and
extras that are each enough for what they name. Built from a copy of the sources (so
no build files land in the work tree); nothing is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser

import pytest

from tests.support.servers import free_port
from tests.support.workers import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    source = tmp_path_factory.mktemp("source")
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    shutil.copytree(
        ROOT / "celery_exclusive",
        source / "celery_exclusive",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(source)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("celery_exclusive-*.whl")
    return zipfile.ZipFile(built)


def dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def test_the_wheel_ships_py_typed(wheel):
    assert "celery_exclusive/py.typed" in wheel.namelist()


def test_the_wheel_registers_the_pytest_plugin(wheel):
    entry_points = dist_info(wheel, "entry_points.txt")
    section = entry_points.split("[pytest11]")[1].split("[")[0]
    assert section.split() == ["celery_exclusive", "=", "celery_exclusive.testing"]


def test_the_redis_extra_brings_celerys_redis_transport_and_its_imports(wheel):
    """kombu's Redis transport imports ``packaging``, which only kombu[redis] (through
    celery[redis]) installs: redis-py alone cannot serve as a broker."""
    metadata = Parser().parsestr(dist_info(wheel, "METADATA"))
    requires = metadata.get_all("Requires-Dist")
    assert 'celery[redis]>=5.3; extra == "redis"' in requires
    assert 'redis>=5.0; extra == "redis"' in requires
    assert 'redis[hiredis]>=5.0; extra == "hiredis"' in requires
    assert 'urllib3>=1.26; extra == "consul"' in requires
    assert {'rq>=2.1; extra == "rq"', 'redis>=5.0; extra == "rq"'} <= set(requires)


#: The modules users import first, and those whose types this package answers for here.
TYPED_MODULES = [
    "__init__.py",
    "core/config.py",
    "errors.py",
    "cli/__init__.py",
    "cli/commands.py",
    "cli/display.py",
    "testing.py",
]


def mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_public_modules_type_check_strictly():
    paths = [f"celery_exclusive/{name}" for name in TYPED_MODULES]
    # Celery ships no types: subclassing its Task is subclassing Any.
    out = mypy("--strict", "--allow-subclassing-any", *paths)
    assert out.returncode == 0, out.stdout


def test_a_users_mistake_with_the_public_api_is_caught_by_mypy(tmp_path):
    user = tmp_path / "user.py"
    user.write_text(
        "from celery_exclusive import DuplicateSkipped, Settings\n"
        "def holder(error: DuplicateSkipped) -> str:\n"
        "    return error.holder_task_id\n"  # Optional[str]: may be None
        "ttl: str = Settings(backend_url='memory://').lease_ttl\n"
    )
    out = mypy("--strict", str(user))
    assert 'user.py:3: error: Incompatible return value type (got "str | None"' in out.stdout
    assert 'user.py:4: error: Incompatible types in assignment (expression has type "float"' in (
        out.stdout
    )


def test_the_wheel_ships_the_web_views_page(wheel):
    names = wheel.namelist()
    for asset in ("index.html", "app.js", "style.css"):
        assert f"celery_exclusive/web/static/{asset}" in names


def test_the_web_extra_names_its_server_libraries(wheel):
    metadata = Parser().parsestr(dist_info(wheel, "METADATA"))
    requires = metadata.get_all("Requires-Dist")
    assert {'starlette>=0.37; extra == "web"', 'uvicorn>=0.29; extra == "web"'} <= set(requires)


def test_the_web_extra_alone_serves_the_page_from_a_clean_environment(wheel, tmp_path):
    """A fresh virtual environment with the wheel and its ``web`` extra, nothing else:
    ``celery-exclusive web`` serves the page and its script."""
    import time
    import urllib.request

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{wheel.filename}[web]"],
        check=True,
        timeout=600,
    )
    port = free_port()
    store = f"sqlite:///{tmp_path}/leases.db"
    server = subprocess.Popen(
        [str(venv / "bin" / "celery-exclusive"), "--backend", store, "web", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None, server.stdout.read().decode()
                assert time.monotonic() < deadline, "the web view did not start"
                time.sleep(0.2)
        assert b'src="static/app.js"' in page
        script = urllib.request.urlopen(f"http://127.0.0.1:{port}/static/app.js", timeout=5)
        assert script.status == 200
    finally:
        server.terminate()
        server.wait(20)
