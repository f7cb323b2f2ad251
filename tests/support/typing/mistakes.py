"""Typical mistakes with the public API: mypy --strict and pyright must each report an
error on every line marked ``# E`` (with what is wrong there), and on no other line."""

from celery_exclusive import DuplicateSkipped, ExclusiveTask, Settings
from celery_exclusive.rq import exclusive


@exclusive(key="invoice:{invoice_id}", on_duplicate="requeue")
def settle(invoice_id: int) -> str:
    return f"invoice {invoice_id} settled"


@exclusive(on_duplicate="drop")  # E: not a duplicate policy
def sync(account_id: int) -> None: ...


@exclusive(lease_ttl="60")  # E: seconds are a number
def refund(order_id: int) -> str:
    return str(order_id)


@exclusive(job_timeout=60)  # E: RQ's own option, not the decorator's
def ship(order_id: int) -> None: ...


@exclusive
def count(order_id: int) -> int:
    return order_id


total: int = count(1) + count(2)  # a bare @exclusive keeps the function's type
label: int = settle(7)  # E: @exclusive(...) keeps it too: settle returns str


class Sync(ExclusiveTask):
    exclusive_key = "account:{account_id}"
    exclusive_on_duplicate = "drop"  # E: not a duplicate policy
    exclusive_lease_ttl = "soon"  # E: not seconds


def holder(error: DuplicateSkipped) -> str:
    return error.holder_task_id  # E: may be None


ttl: str = Settings(backend_url="memory://").lease_ttl  # E: seconds are a float
