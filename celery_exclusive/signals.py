"""Signals users can connect to, sent by the lease and policy layers.

Each is sent with ``sender`` = the task (or job function) name and keyword
arguments ``key`` and ``task_id``; the extra arguments are listed per signal.
Receivers run in the worker process that holds (or missed) the lease.
"""

from celery.utils.dispatch import Signal

#: A lease was granted. Extra: ``fencing_token``.
lease_acquired = Signal(name="lease_acquired", providing_args={"key", "task_id", "fencing_token"})

#: A lease was given back by its holder. Extra: ``held_for`` (seconds).
lease_released = Signal(name="lease_released", providing_args={"key", "task_id", "held_for"})

#: A held lease was found gone while its holder ran. Extra: ``reason`` (what was found)
#: and ``cause``: ``expired``, ``taken``, ``released`` (by an operator), ``reset`` (the
#: store forgot it) or ``unknown`` (see celery_exclusive.errors.LOSS_ADVICE).
lease_lost = Signal(name="lease_lost", providing_args={"key", "task_id", "reason", "cause"})

#: A call found its key held. Extra: ``policy`` (skip/requeue/wait/rerun), ``holder_task_id``.
duplicate_detected = Signal(
    name="duplicate_detected", providing_args={"key", "task_id", "policy", "holder_task_id"}
)

#: A call stood in its key's line (a ``wait`` or ``rerun`` duplicate, a priority caller,
#: a lock that waits). Extra: ``waited`` (seconds) and ``granted`` (whether its turn came).
lease_waited = Signal(name="lease_waited", providing_args={"key", "task_id", "waited", "granted"})
