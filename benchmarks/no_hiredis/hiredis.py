"""Put first on ``PYTHONPATH``, this hides an installed hiredis: redis-py then parses
replies with its own parser, as the default ``pip install 'celery-exclusive[redis]'``
(which has no hiredis) does. See ``benchmarks/stream.py``."""

raise ImportError("hiredis is hidden by benchmarks/no_hiredis")
