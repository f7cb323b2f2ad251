"""RQ integration: a job class that runs marked job functions only under their lease.

Mark the functions that must not run twice at once, and start the workers with the
job class::

    from celery_exclusive.rq import exclusive

    @exclusive(key="invoice:{invoice_id}", on_duplicate="requeue")
    def settle(invoice_id): ...

    $ rq worker --with-scheduler --job-class celery_exclusive.rq.ExclusiveJob

- :mod:`.options`: the decorator's settings, from the one list in ``config.Settings``,
  the environment (``EXCLUSIVE_<NAME>``) and the job's own Redis.
- :mod:`.calls`: ``@exclusive`` and what a marked function does when called: run
  under the lease its job took, take one itself when called directly, or refuse in a
  job that is not an ``ExclusiveJob``.
- :mod:`.job`: ``ExclusiveJob``, which takes the lease in the work horse, carries out
  the duplicate policies in RQ's terms, and frees a dead horse's lease from the
  worker process.

The docs' RQ page (how-to/rq.md) says what each duplicate policy does to a job's status.
"""

from .calls import current_lease, exclusive
from .checks import check_environment
from .job import META_KEY, ExclusiveJob
from .options import ENV_PREFIX

# A worker started with --job-class celery_exclusive.rq.ExclusiveJob, and every process
# that enqueues a marked function, imports this: a misspelt EXCLUSIVE_* stops it here.
check_environment()

__all__ = ["ENV_PREFIX", "META_KEY", "ExclusiveJob", "current_lease", "exclusive"]
