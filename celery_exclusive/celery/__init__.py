"""The Celery integration: the task class (:mod:`.task`), the worker's side of it
(:mod:`.worker`) and the checks a worker runs at start (:mod:`.startup`)."""
