"""What the built wheel carries: type information, the pytest plugin's entry point, and
extras that are each enough for what they name; and the release: scripts/release.sh
builds and checks the sdist and the wheel, run by the release workflow on a tag. Built
from a copy of the sources (so no build files land in the work tree); anything installed
goes into a virtual environment of its own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: the docs extra installs tomli
    import tomli as tomllib  # type: ignore[no-redef]

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


# --- the release ------------------------------------------------------------------------


def release(checkout, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``bash scripts/release.sh`` in ``checkout``, with this Python first on the PATH."""
    return subprocess.run(
        ["bash", "scripts/release.sh", *args],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            **(env or {}),
        },
    )


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """What the release builds from, copied, so that no build files land in the work tree."""
    copy = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, copy)
    for folder in ("celery_exclusive", "scripts", "example_project"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_release_script_builds_and_checks_the_sdist_and_the_wheel(checkout):
    out = release(checkout, "--no-example")
    assert out.returncode == 0, out.stdout + out.stderr
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    sdist = f"dist/celery_exclusive-{version}.tar.gz"
    wheel = f"dist/celery_exclusive-{version}-py3-none-any.whl"
    assert sorted(p.name for p in (checkout / "dist").iterdir()) == sorted(
        [Path(sdist).name, Path(wheel).name]
    )
    for built in (sdist, wheel):
        assert re.search(rf"Checking {re.escape(built)}: \S*PASSED", out.stdout), out.stdout
    assert out.stdout.rstrip().endswith(f"python3 -m twine upload {sdist} {wheel}")
    with tarfile.open(checkout / sdist) as packed:
        names = packed.getnames()
    assert f"celery_exclusive-{version}/README.md" in names
    assert f"celery_exclusive-{version}/celery_exclusive/web/static/app.js" in names


def test_the_release_script_refuses_a_tag_that_is_not_the_version(checkout):
    out = release(checkout, "--no-example", env={"RELEASE_TAG": "v0.0.0-not-this"})
    assert out.returncode == 1
    assert "the tag v0.0.0-not-this does not name the version in pyproject.toml" in out.stderr
    assert "== build" not in out.stdout


def test_the_release_extra_brings_the_tools_the_script_uses(wheel):
    metadata = Parser().parsestr(dist_info(wheel, "METADATA"))
    requires = set(metadata.get_all("Requires-Dist"))
    assert {'build>=1.2; extra == "release"', 'twine>=6.1; extra == "release"'} <= requires


def test_the_release_workflow_runs_the_script_on_a_tag():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    # YAML 1.1 reads the key "on" as True.
    assert workflow[True]["push"]["tags"] == ["v*"]
    (job,) = workflow["jobs"].values()
    runs = [step["run"] for step in job["steps"] if "run" in step]
    assert runs == ["bash scripts/release.sh --upload"]
    assert [s["env"]["RELEASE_TAG"] for s in job["steps"] if "run" in s] == [
        "${{ github.ref_name }}"
    ]


def test_the_readme_installs_from_a_checkout_while_the_package_is_not_published():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    (command,) = re.findall(r"```sh\n(.*?)\n```", install, re.S)
    assert command == "pip install '.[redis]'"
    assert "not on PyPI yet" in install
