"""pytest plugin for .ci/celery-integration: Celery's integration suite with every task an
ExclusiveTask.

Celery's conftest builds its test app from the ``celery_parameters`` fixture (defined
again here, so ``task_cls`` reaches every task of ``t/integration/tasks.py``) and reads
extra settings from ``integration-tests-config.json`` in its root, which the script
writes (``exclusive_on_duplicate``).

CELERY_INTEGRATION_TASK_CLS   the base class of every task (default: ExclusiveTask;
                              ``celery.app.task:Task`` runs the suite plainly)
CELERY_INTEGRATION_TESTS      file listing the test ids to run (others are deselected)
CELERY_INTEGRATION_SKIP       file listing test ids to leave out (those that failed with
                              plain Task when the list was checked on another version)
CELERY_INTEGRATION_CONCURRENCY  pool processes of the suite's worker (Celery's default
                              for it: 1, so that no two tasks ever run at once)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TASK_CLS = os.environ.get("CELERY_INTEGRATION_TASK_CLS", "celery_exclusive:ExclusiveTask")


def _ids(variable: str) -> set[str] | None:
    path = os.environ.get(variable)
    if not path:
        return None
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return {line for line in lines if line.startswith("t/")}


@pytest.fixture(scope="session")
def celery_parameters():
    return {"task_cls": TASK_CLS}


@pytest.fixture(scope="session")
def celery_worker_parameters():
    concurrency = os.environ.get("CELERY_INTEGRATION_CONCURRENCY")
    return {"concurrency": int(concurrency)} if concurrency else {}


def pytest_report_header(config):
    return f"celery-integration: task_cls={TASK_CLS}"


def pytest_collection_modifyitems(config, items):
    wanted, unwanted = _ids("CELERY_INTEGRATION_TESTS"), _ids("CELERY_INTEGRATION_SKIP")
    selected, deselected = [], []
    for item in items:
        if (wanted is None or item.nodeid in wanted) and item.nodeid not in (unwanted or ()):
            selected.append(item)
        else:
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    if wanted is not None:
        missing = wanted - {item.nodeid for item in items} - (unwanted or set())
        if missing:
            print(f"celery-integration: {len(missing)} listed tests are not in this suite")
