"""How a call's arguments become its lease key."""

from __future__ import annotations

import datetime
import uuid

import pytest

from celery_exclusive.errors import ExclusiveKeyError
from celery_exclusive.keys import MAX_KEY_LENGTH, build_key, check_key_spec


def settle(invoice_id, currency="EUR", *, dry_run=False):
    pass


def test_the_default_key_is_the_task_name_and_every_bound_argument():
    assert build_key("billing.settle", settle, None, (7,), {}) == (
        'billing.settle:{"currency":"EUR","dry_run":false,"invoice_id":7}'
    )


def test_positional_and_keyword_calls_share_the_default_key():
    assert build_key("t", settle, None, (7, "EUR"), {}) == build_key(
        "t", settle, None, (), {"invoice_id": 7}
    )


def test_different_arguments_give_different_default_keys():
    assert build_key("t", settle, None, (7,), {}) != build_key("t", settle, None, (8,), {})


def test_a_long_default_key_is_hashed():
    key = build_key("t", settle, None, ("x" * 500,), {})
    assert len(key) <= MAX_KEY_LENGTH
    assert key.startswith("t:sha256:")


def test_dates_uuids_and_sets_have_canonical_keys():
    when, ident = datetime.date(2026, 1, 2), uuid.UUID(int=1)
    assert build_key("t", settle, None, (when, ident), {}) == build_key(
        "t", settle, None, (when, ident), {}
    )
    assert build_key("t", settle, None, ({3, 1, 2},), {}) == build_key(
        "t", settle, None, ({1, 2, 3},), {}
    )


def test_a_format_string_is_filled_from_bound_arguments_including_defaults():
    assert build_key("t", settle, "invoice:{invoice_id}:{currency}", (7,), {}) == "invoice:7:EUR"


def test_a_list_of_names_keys_on_those_arguments_only():
    assert build_key("t", settle, ["invoice_id"], (7, "USD"), {}) == 't:{"invoice_id":7}'


def test_a_callable_key_gets_the_raw_args_and_kwargs():
    spec = lambda args, kwargs: f"inv-{args[0]}-{kwargs['currency']}"  # noqa: E731
    assert build_key("t", settle, spec, (7,), {"currency": "USD"}) == "inv-7-USD"


def test_a_missing_argument_names_the_task_and_the_argument():
    with pytest.raises(ExclusiveKeyError) as info:
        build_key("billing.settle", settle, None, (), {})
    assert info.value.task == "billing.settle"
    assert info.value.argument == "invoice_id"
    assert "billing.settle" in str(info.value)


def test_an_unserializable_argument_is_named_not_replaced_by_a_global_lock():
    with pytest.raises(ExclusiveKeyError) as info:
        build_key("billing.settle", settle, None, (object(),), {})
    assert info.value.argument == "invoice_id"
    assert "exclusive_key" in str(info.value)


def test_a_format_field_that_is_not_an_argument_is_named():
    with pytest.raises(ExclusiveKeyError) as info:
        build_key("t", settle, "invoice:{invoice}", (7,), {})
    assert info.value.argument == "invoice"


def test_a_list_naming_an_unknown_argument_is_an_error():
    with pytest.raises(ExclusiveKeyError, match="'customer'"):
        build_key("t", settle, ["customer"], (7,), {})


def test_a_callable_that_raises_is_reported_with_the_task_name():
    def broken(args, kwargs):
        raise KeyError("tenant")

    with pytest.raises(ExclusiveKeyError, match="t: the exclusive_key callable raised KeyError"):
        build_key("t", settle, broken, (7,), {})


def test_a_callable_must_return_a_non_empty_string():
    with pytest.raises(ExclusiveKeyError, match="non-empty str"):
        build_key("t", settle, lambda a, k: None, (7,), {})


def test_positional_format_fields_are_refused():
    with pytest.raises(ExclusiveKeyError, match="must name arguments"):
        build_key("t", settle, "invoice:{0}", (7,), {})


def test_a_key_spec_that_can_never_be_built_is_caught_before_any_call():
    with pytest.raises(ExclusiveKeyError, match="'invoice'"):
        check_key_spec("t", settle, "invoice:{invoice}")
    check_key_spec("t", settle, "invoice:{invoice_id}")
