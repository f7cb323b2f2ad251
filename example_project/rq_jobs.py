"""The example's RQ side: refunds, excluded per invoice exactly like Celery's settle.

Runs only with ``python -m example_project --redis URL``: RQ needs a Redis server.
"""

from __future__ import annotations

import time

from celery_exclusive.rq import current_lease, exclusive


@exclusive(key="invoice:{invoice_id}", on_duplicate="skip", lease_ttl=10)
def refund(invoice_id: int) -> dict:
    started = time.time()
    time.sleep(0.5)
    return {
        "ran": True,
        "fencing_token": current_lease().fencing_token,
        "started": started,
        "ended": time.time(),
    }
