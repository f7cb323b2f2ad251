"""docker-compose.yml is for users (no Docker engine runs here): check it by parsing."""

from __future__ import annotations

import importlib
import shlex

import yaml

from tests.workers import ROOT


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
    for name, argv in commands.items():
        module = argv[argv.index("-A") + 1]
        assert importlib.import_module(module).app, name


def test_every_scheduler_a_beat_names_can_be_loaded():
    for name, argv in celery_commands().items():
        if "-S" in argv:
            target = argv[argv.index("-S") + 1]
            if ":" in target:
                module, attr = target.split(":")
                assert getattr(importlib.import_module(module), attr), name


def test_the_workers_share_one_lease_store_and_broker():
    workers = [s for s in compose()["services"].values() if "worker" in s.get("command", "")]
    assert len(workers) == 3
    assert len({s["environment"]["EXAMPLE_BACKEND_URL"] for s in workers}) == 1
    assert len({s["environment"]["EXAMPLE_BROKER_URL"] for s in workers}) == 1
