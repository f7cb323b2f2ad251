"""What a task pays per call to see settings changed after its first call.

    python -m benchmarks.settings_lookup

In one process, no store: the time of ``task.exclusive_settings`` as it is (one
generation comparison), against the alternatives it was chosen over: returning a
cached value that never changes (the floor), comparing a fingerprint of the app's
``exclusive_*`` settings at every call, and resolving every setting at every call.
Variants alternate over several rounds; the median round is reported, in
nanoseconds per call.
"""

from __future__ import annotations

import sys
import time

from celery import Celery

from benchmarks.common import median
from celery_exclusive import ExclusiveTask
from celery_exclusive.core import config


def _app_task():
    app = Celery("bench", broker="memory://", set_as_current=False)
    app.conf.update(exclusive_backend_url="memory://bench", exclusive_lease_ttl=10)

    @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}")
    def settle(invoice_id):
        pass

    task = app.tasks[settle.name]  # the task itself, not the module-level proxy
    assert task.exclusive_settings  # resolve once
    return app, task


def variants() -> dict:
    app, task = _app_task()
    cached = task.exclusive_settings
    conf = app.conf
    names = [config.setting_name(name) for name in config.NAMES]

    def floor():
        return cached

    def generation():
        return task.exclusive_settings

    def fingerprint():
        return tuple(conf.get(name) for name in names)

    def resolve():
        return config.for_app(app, task.name, lambda name: getattr(task, f"exclusive_{name}"))

    return {
        "cached forever": floor,
        "generation check": generation,
        "fingerprint of exclusive_* settings": fingerprint,
        "resolve every call": resolve,
    }


def run(calls: int = 200_000, rounds: int = 5) -> dict:
    funcs = variants()
    samples: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(rounds):
        for name, func in funcs.items():
            n = calls if name != "resolve every call" else calls // 20
            started = time.perf_counter()
            for _ in range(n):
                func()
            samples[name].append((time.perf_counter() - started) / n * 1e9)
    return {name: round(median(values), 1) for name, values in samples.items()}


def main() -> None:
    result = run()
    print(f"Python {sys.version.split()[0]}; ns per call, median of 5 rounds")
    for name, ns in result.items():
        print(f"{name:40} {ns:10.1f}")


if __name__ == "__main__":
    main()
