"""What only the MongoDB store has to show, on the wire-protocol stand-in (or the real
server at MONGODB_URL), and the stand-in's own rules, each against its source."""

from __future__ import annotations

import datetime
import time
import uuid

import pymongo
import pytest
from bson.objectid import ObjectId
from pymongo.errors import OperationFailure

from celery_exclusive.backends import _load
from celery_exclusive.backends.mongodb.connection import COLLECTION
from celery_exclusive.errors import BackendUnavailable, ConfigurationError
from tests.support.mongo_standin import MongoStandIn
from tests.support.servers import free_port


@pytest.fixture
def store(mongodb_url):
    backend = _load(mongodb_url)
    yield backend
    backend.close()


@pytest.fixture
def documents(store):
    return store.connection.collection().with_options(write_concern=pymongo.WriteConcern(1))


def test_a_deleted_document_does_not_reset_the_fencing_token(store, documents):
    first = store.try_acquire("k", uuid.uuid4().hex, 10)
    store.release(first)
    # The floor is the server's clock to the millisecond: no hand deletes the document
    # within the millisecond of its last grant, and the TTL index waits a day.
    time.sleep(0.002)
    documents.delete_one({"_id": "k"})  # the TTL index, or an operator
    second = store.try_acquire("k", uuid.uuid4().hex, 10)
    assert second.fencing_token > first.fencing_token


def test_a_refused_grant_leaves_the_document_as_it_was(store, documents):
    store.try_acquire("k", uuid.uuid4().hex, 10)
    before = documents.find_one({"_id": "k"})
    assert store.try_acquire("k", uuid.uuid4().hex, 10) is None
    assert documents.find_one({"_id": "k"}) == before


def test_the_gc_index_is_a_ttl_index_on_gc_at(store, documents):
    store.try_acquire("k", uuid.uuid4().hex, 10)
    indexes = {i["name"]: i for i in documents.list_indexes()} if _real(store) else None
    if indexes is not None:
        assert indexes["gc_at_ttl"]["expireAfterSeconds"] == 0
    doc = documents.find_one({"_id": "k"})
    assert doc["gc_at"] > datetime.datetime.now() + datetime.timedelta(hours=23)


def test_a_server_that_does_not_answer_is_unavailable():
    backend = _load(f"mongodb://127.0.0.1:{free_port()}/x?serverSelectionTimeoutMS=300")
    with pytest.raises(BackendUnavailable):
        backend.check("exclusive:~check")


def test_a_collection_named_without_the_recipe_is_refused_naming_the_fix(mongodb_url):
    # collection= names the lease documents of ?recipe=ttl-lease; pymongo knows no such option.
    with pytest.raises(ConfigurationError, match="collection=.*add recipe=ttl-lease"):
        _load(mongodb_url + "?collection=locks")


def _real(store) -> bool:
    return "stand-in" not in store.connection.collection().database.client.server_info()["version"]


# --- the stand-in's rules, each as the MongoDB source it cites has it -------------------


@pytest.fixture
def standin():
    server = MongoStandIn().start()
    client = pymongo.MongoClient(server.url, serverSelectionTimeoutMS=2000)
    yield server, client["db"]["c"]
    client.close()
    server.stop()


def test_standin_an_upsert_whose_filter_is_only_the_id_updates_the_existing_document(standin):
    # write_ops_exec.cpp shouldRetryDuplicateKeyException: AND-of-EQ queries match.
    _, c = standin
    c.update_one({"_id": "k"}, [{"$set": {"n": 1}}], upsert=True)
    c.update_one({"_id": "k"}, [{"$set": {"n": 2}}], upsert=True)
    assert c.find_one({"_id": "k"})["n"] == 2


def test_standin_an_upsert_may_not_test_its_query_with_expr(standin):
    # parsed_update.cpp: QueryFeatureNotAllowed (224), whether a document matches or not.
    _, c = standin
    c.update_one({"_id": "k"}, [{"$set": {"n": 1}}], upsert=True)
    with pytest.raises(OperationFailure) as info:
        c.update_one({"_id": "k", "$expr": {"$eq": ["$n", 1]}}, [{"$set": {"n": 3}}], upsert=True)
    assert info.value.code == 224
    c.update_one({"_id": "k", "$expr": {"$eq": ["$n", 1]}}, [{"$set": {"n": 3}}])
    assert c.find_one({"_id": "k"})["n"] == 3


def test_standin_now_is_one_value_for_the_whole_command(standin):
    # variables.cpp: $$NOW is fixed once per operation.
    _, c = standin
    c.update_one({"_id": "k"}, [{"$set": {"a": "$$NOW"}}, {"$set": {"b": "$$NOW"}}], upsert=True)
    doc = c.find_one({"_id": "k"})
    assert doc["a"] == doc["b"]


def test_standin_size_of_a_missing_field_is_error_17124(standin):
    _, c = standin
    c.update_one({"_id": "k"}, [{"$set": {"n": 1}}], upsert=True)
    with pytest.raises(OperationFailure) as info:
        list(c.aggregate([{"$project": {"s": {"$size": "$nothing"}}}]))
    assert info.value.code == 17124


def test_standin_missing_and_null_sort_before_dates(standin):
    # bsontypes.cpp canonicalizeBSONType: null/missing < ... < Date.
    _, c = standin
    c.update_one({"_id": "k"}, [{"$set": {"n": 1}}], upsert=True)
    [doc] = c.aggregate([{"$project": {"gt": {"$gt": ["$nothing", "$$NOW"]}}}])
    assert doc["gt"] is False


def test_standin_ttl_pass_deletes_documents_whose_date_has_passed(standin):
    # ttl.cpp TTLMonitor: expireAfterSeconds past the indexed date; non-dates stay.
    server, c = standin
    c.create_index("gc_at", expireAfterSeconds=0)
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    c.update_one({"_id": "old"}, [{"$set": {"gc_at": {"$literal": past}}}], upsert=True)
    c.update_one({"_id": "new"}, [{"$set": {"gc_at": {"$add": ["$$NOW", 60000]}}}], upsert=True)
    c.update_one({"_id": "kept"}, [{"$set": {"gc_at": "not a date"}}], upsert=True)
    assert server.store.ttl_pass() == 1
    assert sorted(d["_id"] for d in c.find({})) == ["kept", "new"]


def test_standin_refuses_what_it_does_not_implement(standin):
    _, c = standin
    with pytest.raises(OperationFailure):
        c.replace_one({"_id": "k"}, {"n": 1}, upsert=True)


def test_standin_insert_refuses_a_second_document_with_the_same_id(standin):
    # insert.cpp fixDocumentForInsert; index_entry_comparison.cpp buildDupKeyErrorStatus.
    _, c = standin
    c.insert_one({"_id": "k", "n": 1})
    with pytest.raises(pymongo.errors.DuplicateKeyError) as info:
        c.insert_one({"_id": "k", "n": 2})
    assert info.value.code == 11000
    assert "E11000 duplicate key error collection: db.c index: _id_ dup key" in str(info.value)
    assert c.find_one({"_id": "k"})["n"] == 1


def test_standin_insert_gives_a_document_without_id_an_object_id_first(standin):
    _, c = standin
    c.database.command("insert", "c", documents=[{"n": 1}])
    [doc] = c.find({"n": 1})
    assert isinstance(doc["_id"], ObjectId) and next(iter(doc)) == "_id"


def test_standin_modifiers_set_inc_and_unset(standin):
    # set_node.cpp, arithmetic_node.cpp (a missing field counts as 0), unset_node.cpp.
    _, c = standin
    c.insert_one({"_id": "k", "gone": 1})
    c.update_one({"_id": "k"}, {"$set": {"a.b": 2}, "$inc": {"n": 5}, "$unset": {"gone": ""}})
    assert c.find_one({"_id": "k"}) == {"_id": "k", "a": {"b": 2}, "n": 5}
    with pytest.raises(OperationFailure) as info:
        c.update_one({"_id": "k"}, {"$inc": {"a": 1}})
    assert info.value.code == 14  # TypeMismatch


def test_standin_set_on_insert_applies_only_when_the_upsert_inserts(standin):
    _, c = standin
    for n in (1, 2):
        c.update_one({"_id": "k"}, {"$set": {"n": n}, "$setOnInsert": {"first": n}}, upsert=True)
    assert c.find_one({"_id": "k"}) == {"_id": "k", "n": 2, "first": 1}


def test_standin_exists_matches_whether_a_path_names_a_value(standin):
    # ExistsMatchExpression: null exists; missing does not.
    _, c = standin
    c.insert_many([{"_id": 1, "f": None}, {"_id": 2}])
    assert [d["_id"] for d in c.find({"f": {"$exists": True}})] == [1]
    assert [d["_id"] for d in c.find({"f": {"$exists": False}})] == [2]


def test_standin_type_and_object_to_array_of_root(standin):
    # ExpressionType (bsontypes.cpp typeName, "missing"); ExpressionObjectToArray; $$ROOT.
    _, c = standin
    c.insert_one({"_id": "k", "d": datetime.datetime(2026, 1, 1), "s": "x"})
    [doc] = c.aggregate(
        [
            {
                "$project": {
                    "types": [{"$type": "$d"}, {"$type": "$s"}, {"$type": "$nothing"}],
                    "fields": {"$size": {"$objectToArray": "$$ROOT"}},
                }
            }
        ]
    )
    assert doc["types"] == ["date", "string", "missing"]
    assert doc["fields"] == 3


def test_standin_ttl_pass_goes_by_the_earliest_date_of_an_array(standin):
    # ttl.cpp _deleteExpiredWithIndex: index keys of each element between the dawn of
    # time and now - expireAfterSeconds, both included.
    server, c = standin
    c.create_index("at", expireAfterSeconds=0)
    now = datetime.datetime.now(datetime.timezone.utc)
    c.insert_one({"_id": "mixed", "at": [now + datetime.timedelta(hours=1), now]})
    c.insert_one({"_id": "later", "at": [now + datetime.timedelta(hours=1)]})
    assert server.store.ttl_pass() == 1
    assert [d["_id"] for d in c.find({})] == ["later"]


def test_standin_ttl_monitor_sleeps_60_seconds_between_passes_by_default():
    # src/mongo/db/ttl/ttl.idl: ttlMonitorSleepSecs, default 60.
    assert MongoStandIn().store.ttl_monitor_sleep == 60


def test_standin_an_index_asked_for_again_conflicts_only_if_it_differs(standin):
    # jstests/core/ddl/create_index_same_spec_different_name.js, create_indexes.js.
    _, c = standin
    c.create_index("at", expireAfterSeconds=60)
    c.create_index("at", expireAfterSeconds=60)  # the same: nothing to do
    with pytest.raises(OperationFailure) as info:
        c.create_index("at", expireAfterSeconds=0)
    assert info.value.code == 85  # IndexOptionsConflict
    with pytest.raises(OperationFailure) as info:
        c.create_index("at", name="other")
    assert info.value.code == 85
    with pytest.raises(OperationFailure) as info:
        c.create_index("n", name="at_1")
    assert info.value.code == 86  # IndexKeySpecsConflict


def test_the_store_uses_the_collection_it_documents(store, documents):
    store.try_acquire("k", uuid.uuid4().hex, 10)
    assert documents.name == COLLECTION
    assert documents.find_one({"_id": "k"})["holders"][0]["o"]
