"""The core: leases as their holders see them, and what is decided about a call.

Settings (:mod:`.config`), keys (:mod:`.keys`), the held lease and its heartbeat
(:mod:`.lease`, :mod:`.heartbeat`), marks beside a lease key (:mod:`.marks`), the
duplicate policies (:mod:`.policies`), stopping a holder whose lease is lost
(:mod:`.terminate`) and freeing a dead holder's lease (:mod:`.reaper`). It builds on
the stores (:mod:`celery_exclusive.backends`) and knows nothing of Celery or RQ.
"""
