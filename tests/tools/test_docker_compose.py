"""docker-compose.yml is for users (no Docker engine runs here): check it by parsing."""

from __future__ import annotations

import importlib
import shlex
import subprocess
import sys
from importlib.metadata import entry_points

import yaml

from tests.support.workers import ROOT


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def celery_commands() -> dict[str, list[str]]:
    return {
        name: shlex.split(service["command"])
        for name, service in compose()["services"].items()
        if service.get("command", "").startswith("celery")
    }


def test_every_service_has_an_image_or_a_build_that_exists():
    for name, service in compose()["services"].items():
        assert "image" in service or (ROOT / service["build"] / "Dockerfile").exists(), name


def test_every_celery_command_names_an_app_module_that_imports():
    commands = celery_commands()
    assert commands, "no celery services"
    for argv in commands.values():
        module = argv[argv.index("-A") + 1]
        # In a process of its own, as a worker imports it (an app connects its handlers).
        check = f"import {module}; assert {module}.app"
        subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)


def test_two_beats_run_the_leader_elected_scheduler():
    beats = [argv for argv in celery_commands().values() if "beat" in argv]
    assert len(beats) == 2
    for argv in beats:
        target = argv[argv.index("-S") + 1]
        if ":" not in target:  # an alias from the celery.beat_schedulers entry points
            [entry] = [e for e in entry_points(group="celery.beat_schedulers") if e.name == target]
            target = entry.value
        module, attr = target.split(":")
        assert getattr(importlib.import_module(module), attr).__name__ == "LeaderScheduler"


def test_the_rq_worker_uses_the_exclusive_job_class():
    [rq] = [
        shlex.split(s["command"])
        for s in compose()["services"].values()
        if s.get("command", "").startswith("rq ")
    ]
    module, _, attr = rq[rq.index("--job-class") + 1].rpartition(".")
    assert getattr(importlib.import_module(module), attr)


def test_the_workers_share_one_lease_store_and_broker():
    workers = [
        s
        for s in compose()["services"].values()
        if s.get("command", "").startswith("celery") and " worker " in s["command"]
    ]
    assert len(workers) == 3
    assert len({s["environment"]["EXAMPLE_BACKEND_URL"] for s in workers}) == 1
    assert len({s["environment"]["EXAMPLE_BROKER_URL"] for s in workers}) == 1
