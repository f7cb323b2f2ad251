"""How a call's arguments become its lease key."""

from __future__ import annotations

import datetime
import decimal
import pickle
import uuid

import pytest
from celery.app.task import Context

from celery_exclusive.core.keys import (
    MAX_KEY_LENGTH,
    KeyBinder,
    build_key,
    canonical_text,
    check_key_spec,
)
from celery_exclusive.errors import ExclusiveKeyError


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


def test_bytes_can_be_part_of_a_key():
    assert build_key("t", settle, None, (b"\x00\xff7",), {}) == (
        't:{"currency":"EUR","dry_run":false,"invoice_id":bytes("\\u0000\\u00ff7")}'
    )


#: Values that look alike but are different calls: each must get a key of its own.
LOOKALIKES = [
    b"7",
    "7",
    7,
    7.0,
    [7],
    {"7": 7},
    {7},
    datetime.date(2026, 1, 2),
    "2026-01-02",
    datetime.datetime(2026, 1, 2),
    datetime.time(1, 2),
    datetime.timedelta(days=1),
    decimal.Decimal("7"),
    uuid.UUID(int=7),
    str(uuid.UUID(int=7)),
    'bytes("7")',
    None,
    "null",
    ValueError("7"),
]


def test_values_of_different_types_never_share_a_key():
    texts = [canonical_text(value) for value in LOOKALIKES]
    assert len(set(texts)) == len(LOOKALIKES), texts


def test_every_value_celerys_serializers_carry_has_one_text_whatever_its_round_trip():
    from kombu.utils.json import dumps, loads

    call = [
        b"\x00\xffbinary",
        b"text",
        datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc),
        datetime.date(2026, 1, 2),
        datetime.time(3, 4, 5),
        decimal.Decimal("1.10"),
        uuid.UUID(int=7),
        (1, 2),
        {1: "int key", "b": None},
    ]
    assert canonical_text(loads(dumps(call))) == canonical_text(call)
    assert canonical_text(pickle.loads(pickle.dumps(call))) == canonical_text(call)


def test_a_mapping_is_written_in_key_order_whatever_its_insertion_order():
    assert canonical_text({"b": 1, "a": [b"x", {"d": 2, "c": 3}]}) == canonical_text(
        {"a": [b"x", {"c": 3, "d": 2}], "b": 1}
    )


def test_a_value_with_kombus_json_hook_is_keyed_as_kombu_sends_it():
    class Money:
        def __json__(self):
            return {"amount": "1.10", "currency": "EUR"}

    assert canonical_text(Money()) == canonical_text({"amount": "1.10", "currency": "EUR"})


def test_a_new_style_errback_call_is_keyed_on_the_failed_request():
    def on_error(request, exc, traceback):
        pass

    def key(task_id, exc):
        return build_key("t", on_error, None, (Context(id=task_id), exc, "Traceback ..."), {})

    assert key("a", ValueError("boom")) == key("a", ValueError("boom"))
    assert key("a", ValueError("boom")) != key("b", ValueError("boom"))
    assert key("a", ValueError("boom")) != key("a", KeyError("boom"))


def test_a_format_key_can_name_attributes_of_an_errbacks_request():
    def on_error(request, exc, traceback):
        pass

    request = Context(id="a", task="billing.settle")
    call = (request, ValueError("boom"), None)
    assert build_key("t", on_error, "errors:{request.task}", call, {}) == "errors:billing.settle"


def test_a_format_string_is_filled_from_bound_arguments_including_defaults():
    assert build_key("t", settle, "invoice:{invoice_id}:{currency}", (7,), {}) == "invoice:7:EUR"


def test_a_list_of_names_keys_on_those_arguments_only():
    assert build_key("t", settle, ["invoice_id"], (7, "USD"), {}) == 't:{"invoice_id":7}'


def test_a_callable_key_gets_the_raw_args_and_kwargs():
    spec = lambda args, kwargs: f"inv-{args[0]}-{kwargs['currency']}"  # noqa: E731
    assert build_key("t", settle, spec, (7,), {"currency": "USD"}) == "inv-7-USD"


@pytest.mark.parametrize(
    "call",
    [((), {}), ((7, "EUR", "extra"), {}), ((7,), {"wrong_arg": 5})],
    ids=["missing", "too many", "unexpected keyword"],
)
@pytest.mark.parametrize(
    "spec", [None, "invoice:{invoice_id}", lambda a, k: "k"], ids=["default", "format", "callable"]
)
def test_a_call_that_does_not_match_the_signature_raises_the_type_error_a_call_would(call, spec):
    args, kwargs = call
    with pytest.raises(TypeError) as expected:
        settle(*args, **kwargs)
    with pytest.raises(TypeError) as info:
        build_key("billing.settle", settle, spec, args, kwargs)
    assert type(info.value) is TypeError
    assert str(info.value).startswith("settle() ")
    assert str(expected.value).startswith("settle() ")


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


# --- keys every store can keep ----------------------------------------------------------

#: Not text: what bytes decoded with errors="surrogateescape" (os.fsdecode) contain.
LONE_SURROGATE = "7\udcff"


def test_a_format_key_holding_a_lone_surrogate_names_the_task_and_argument():
    with pytest.raises(ExclusiveKeyError, match="billing.settle: .*'invoice_id'.*surrogate") as e:
        build_key("billing.settle", settle, "invoice:{invoice_id}", (LONE_SURROGATE,), {})
    assert (e.value.task, e.value.argument) == ("billing.settle", "invoice_id")


def test_a_callable_key_holding_a_lone_surrogate_is_refused():
    with pytest.raises(ExclusiveKeyError, match="billing.settle: .*surrogate"):
        build_key("billing.settle", settle, lambda args, kwargs: "\ud800", (7,), {})


def test_the_default_key_writes_a_lone_surrogate_escaped():
    key = build_key("t", settle, None, (LONE_SURROGATE,), {})
    assert "\\udcff" in key and key.encode("utf-8")


def test_a_format_string_holding_a_lone_surrogate_is_caught_before_any_call():
    with pytest.raises(ExclusiveKeyError, match="surrogate"):
        check_key_spec("t", settle, "invoice\ud800:{invoice_id}")


# --- a task's key binder: the same keys and errors as build_key -------------------------


def pay(invoice_id, currency="EUR", note=None):
    pass


def spread(*parts, **options):
    pass


BINDER_CALLS = [
    (pay, None, (7,), {}),
    (pay, None, (7, "USD"), {}),
    (pay, None, (), {"invoice_id": 7, "note": "x"}),
    (pay, None, (7,), {"note": {"b": [1, 2.5, None, True]}}),
    (pay, None, ("é\ud800",), {}),  # the default key escapes a lone surrogate
    (pay, None, ("x" * 500,), {}),  # long: hashed
    (pay, None, (b"7", decimal.Decimal("1.10")), {}),
    (pay, None, (7,), {"invoice_id": 8}),  # TypeError: twice
    (pay, None, (7, "EUR", None, 1), {}),  # TypeError: too many
    (pay, None, (), {}),  # TypeError: missing
    (pay, None, (7,), {"amount": 3}),  # TypeError: unknown
    (pay, None, (object(),), {}),  # ExclusiveKeyError: no canonical form
    (pay, "invoice:{invoice_id}:{currency}", (7,), {}),
    (pay, "invoice:{invoice_id}:{note}", (7,), {"note": "\ud800"}),  # not storable
    (pay, "invoice:{0}", (7,), {}),  # positional field
    (pay, "invoice:{amount}", (7,), {}),
    (pay, ["currency"], (7, "USD"), {}),
    (pay, ["amount"], (7,), {}),
    (pay, lambda args, kwargs: f"k{args[0]}", (7,), {}),
    (settle, None, (7,), {"dry_run": True}),  # keyword-only parameter
    (settle, "inv:{invoice_id}", (7,), {}),
    (spread, None, (1, 2), {"a": 3}),
    (print, None, (1,), {}),  # a builtin whose signature may not be introspectable
]


def outcome(build, *call):
    try:
        return build(*call)
    except (TypeError, ExclusiveKeyError) as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize(("function", "spec", "args", "kwargs"), BINDER_CALLS)
def test_a_task_key_binder_gives_the_key_or_error_build_key_gives(function, spec, args, kwargs):
    binder = KeyBinder("t", function, spec)
    assert outcome(binder, args, kwargs) == outcome(build_key, "t", function, spec, args, kwargs)


def test_a_task_key_binder_binds_a_plain_signature_without_inspect(monkeypatch):
    binder = KeyBinder("t", pay, None)
    monkeypatch.setattr("inspect.Signature.bind", None)  # any use of it fails
    assert binder((7,), {"note": "x"}) == 't:{"currency":"EUR","invoice_id":7,"note":"x"}'
