"""Benchmarks of celery-exclusive against its peers, on real Redis servers and workers.

Run them all with ``python -m benchmarks`` (see ``benchmarks/run.py``).
"""
