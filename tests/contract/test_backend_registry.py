"""Stores are found through the ``celery_exclusive.backends`` entry point group, the
built-in ones and anybody else's alike."""

from __future__ import annotations

import importlib
import sys

import pytest

from celery_exclusive import backends
from celery_exclusive.backends import (
    ENTRY_POINT_GROUP,
    Backend,
    Capabilities,
    _declared,
    _load,
    check_capabilities,
    register_scheme,
)
from celery_exclusive.backends.memory import MemoryBackend
from celery_exclusive.errors import ConfigurationError

BUILT_IN = {
    "redis": "redis",
    "rediss": "redis",
    "redis+sentinel": "redis",
    "consul": "consul",
    "consuls": "consul",
    "sqlite": None,
    "memory": None,
    "postgresql": "postgresql",
    "postgres": "postgresql",
    "etcd": "etcd",
    "etcds": "etcd",
    "mongodb": "mongodb",
    "mongodb+srv": "mongodb",
}


def test_every_built_in_store_is_declared_as_an_entry_point_with_its_extra():
    schemes, extras = _declared()
    assert set(BUILT_IN) <= set(schemes)
    assert {s: extras.get(s) for s in BUILT_IN} == BUILT_IN
    for target in {schemes[s] for s in BUILT_IN}:
        module, name = target.split(":")
        assert issubclass(getattr(importlib.import_module(module), name), Backend)


def test_a_store_declared_by_another_distribution_is_found(tmp_path, monkeypatch):
    dist = tmp_path / "acme_leases-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-leases\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nacme = tests.beat.test_beat:NoRecordsBackend [acme]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    schemes, extras = _declared()
    assert schemes["acme"] == "tests.beat.test_beat:NoRecordsBackend"
    assert extras["acme"] == "acme"


@pytest.mark.parametrize(
    "scheme, client, extra",
    [("postgresql", "psycopg", "postgresql"), ("mongodb", "pymongo", "mongodb")],
)
def test_a_missing_client_is_one_line_naming_the_extra_to_install(
    monkeypatch, scheme, client, extra
):
    for name in [m for m in sys.modules if m == client or m.startswith(client + ".")]:
        monkeypatch.delitem(sys.modules, name)
    for name in [m for m in sys.modules if m.startswith(f"celery_exclusive.backends.{scheme}")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, client, None)  # import fails, as if not installed
    with pytest.raises(ConfigurationError) as info:
        _load(f"{scheme}://localhost/x")
    message = str(info.value)
    assert f"pip install 'celery-exclusive[{extra}]'" in message
    assert "\n" not in message


def test_register_scheme_still_adds_a_store_at_run_time(monkeypatch):
    monkeypatch.setattr(backends, "SCHEMES", dict(backends.SCHEMES))
    backends.register_scheme("x-test", "celery_exclusive.backends.memory:MemoryBackend")
    assert type(_load("x-test://a")).__name__ == "MemoryBackend"


class RecordsWithoutMethods(MemoryBackend):
    """Declares records but keeps the base's refusal of them."""

    capabilities = Capabilities(limits=True, records=True, marks=True)
    read_record = Backend.read_record


class MarksWithoutDeclaring(MemoryBackend):
    """Implements marks (inherited) but declares none."""

    capabilities = Capabilities(limits=True, records=True, marks=False)


class NotAStore:
    def __init__(self, url: str) -> None:
        self.url = url


@pytest.mark.parametrize(
    "store, message",
    [
        (RecordsWithoutMethods, "declares records .* does not implement read_record"),
        (
            MarksWithoutDeclaring,
            "implements read_mark\\(\\), swap_mark\\(\\) but does not declare marks",
        ),
        (NotAStore, "is not a celery_exclusive.backends.Backend subclass"),
    ],
    ids=["declared-not-implemented", "implemented-not-declared", "not-a-backend"],
)
def test_a_store_whose_capabilities_do_not_match_its_methods_is_refused_when_it_loads(
    store, message
):
    register_scheme("mismatched", f"{__name__}:{store.__qualname__}")
    try:
        with pytest.raises(ConfigurationError, match=f"{store.__qualname__} {message}"):
            _load("mismatched://")
    finally:
        del backends.SCHEMES["mismatched"]


def load_class(target: str) -> type:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def test_every_built_in_store_and_recipe_declares_what_it_implements():
    schemes, _ = _declared()
    stores = {load_class(target) for target in set(schemes.values())}
    recipes = {load_class(target) for store in stores for target in store.recipes.values()}
    assert len(stores) >= 7 and len(recipes) >= 5  # each ecosystem's own lock recipe
    for store in stores | recipes:
        check_capabilities(store)  # raises on a mismatch
        assert store.capabilities.marks and store.capabilities.records
    for store in stores:  # a recipe's lock has no limit above one; the store's own does
        assert store.capabilities.limits, store.__name__


class WithoutRecords(MemoryBackend):
    """Keeps no records: declares none and keeps the base's methods."""

    capabilities = Capabilities(limits=True, records=False, marks=True)
    read_record = Backend.read_record
    write_record = Backend.write_record


def test_a_record_asked_of_a_store_that_keeps_none_is_a_configuration_error_naming_why():
    store = WithoutRecords("memory://")
    with pytest.raises(ConfigurationError, match="keeps no records .* read_record.* beat"):
        store.read_record("k", "entry")
