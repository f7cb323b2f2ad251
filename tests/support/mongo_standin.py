"""A STAND-IN for a MongoDB server, for CI machines where none can be installed.

It speaks MongoDB's wire protocol (OP_QUERY for the first handshake, OP_MSG after),
so the real pymongo driver, its BSON codec, its server selection and its error
mapping are what the tests exercise. It implements exactly the commands and
operators the ``mongodb://`` store sends, each rule below following the MongoDB
server source it names (mongodb/mongo, ``src/mongo/...``). Everything else is
refused with an error, never guessed. When ``MONGODB_URL`` is set, the tests use
that real server instead (``docker compose up -d mongo``).

What it cannot show (see the README): replica sets, elections and rollback (majority
write/read concern are accepted and mean nothing on one in-memory process), journaling
and restarts, retryable writes and sessions (it advertises no
``logicalSessionTimeoutMinutes``, so pymongo sends none), authentication and TLS,
concurrency between documents (every command runs under one lock, so each is atomic,
as a single-document write is in the real server, but so is everything else), and
the query planner (every match is a scan).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import socket
import socketserver
import struct
import threading
import time
from typing import Any

import bson
from bson.codec_options import CodecOptions
from bson.int64 import Int64
from bson.objectid import ObjectId

from tests.support.servers import free_port

OP_REPLY, OP_QUERY, OP_MSG = 1, 2004, 2013
CODEC = CodecOptions(tz_aware=True)

#: "No value" (a field path that names nothing), distinct from null:
#: src/mongo/db/exec/document_value/value.h (``Value()``, missing).
MISSING = type("Missing", (), {"__repr__": lambda self: "MISSING"})()
#: ``$$REMOVE``: src/mongo/db/pipeline/variables.cpp (kRemoveId evaluates to missing).
REMOVE = MISSING


class CommandError(Exception):
    def __init__(self, code: int, message: str, name: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.name = code, message, name


# --- values: ordering and truth ---------------------------------------------------------


def _rank(value: Any) -> int:
    """Canonical type order, src/mongo/bson/bsontypes.cpp ``canonicalizeBSONType``:
    MinKey < Undefined/null < numbers < string < object < array < binData < ObjectId
    < bool < date < timestamp < regex < MaxKey. Missing sorts before everything."""
    if value is MISSING:
        return -1
    if value is None:
        return 5
    if isinstance(value, bool):
        return 40
    if isinstance(value, (int, float)):
        return 10
    if isinstance(value, str):
        return 15
    if isinstance(value, dict):
        return 20
    if isinstance(value, list):
        return 25
    if isinstance(value, bytes):
        return 30
    if isinstance(value, ObjectId):
        return 35
    if isinstance(value, datetime.datetime):
        return 45
    raise CommandError(2, f"stand-in: unsupported value {value!r}", "BadValue")


def compare(a: Any, b: Any) -> int:
    """src/mongo/db/exec/document_value/value.cpp ``Value::compare``: by canonical type,
    then by value (strings by their UTF-8 bytes, i.e. code points; arrays element-wise)."""
    ra, rb = _rank(a), _rank(b)
    if ra != rb:
        return -1 if ra < rb else 1
    if isinstance(a, list):
        for x, y in zip(a, b):
            c = compare(x, y)
            if c:
                return c
        return (len(a) > len(b)) - (len(a) < len(b))
    if isinstance(a, dict):
        return compare([[k, v] for k, v in a.items()], [[k, v] for k, v in b.items()])
    if a is None or a is MISSING:
        return 0
    return (a > b) - (a < b)


def truthy(value: Any) -> bool:
    """src/mongo/db/exec/document_value/value.cpp ``Value::coerceToBool``: false, null,
    undefined, missing and zero are false; everything else (empty arrays too) is true."""
    if value is MISSING or value is None or value is False:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value != 0
    return True


def nullish(value: Any) -> bool:
    return value is None or value is MISSING


# --- aggregation expressions: src/mongo/db/pipeline/expression.cpp ----------------------


def get_path(doc: Any, path: str) -> Any:
    """A dotted field path (src/mongo/db/exec/document_value/document.cpp
    ``getNestedField``); missing where any step is absent or not a document."""
    for part in path.split("."):
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        else:
            return MISSING
    return doc


def evaluate(expr: Any, root: dict, variables: dict) -> Any:
    if isinstance(expr, str) and expr.startswith("$$"):
        name, _, rest = expr[2:].partition(".")
        if name == "ROOT":  # variables.cpp, kRootId: the document being processed
            value = root
        elif name not in variables:
            raise CommandError(17276, f"Use of undefined variable: {name}", "Location17276")
        else:
            value = variables[name]
        return get_path(value, rest) if rest else value
    if isinstance(expr, str) and expr.startswith("$"):
        return get_path(root, expr[1:])
    if isinstance(expr, list):
        return [_missing_to_null(evaluate(e, root, variables)) for e in expr]
    if isinstance(expr, dict):
        if len(expr) == 1 and next(iter(expr)).startswith("$"):
            name, args = next(iter(expr.items()))
            operator = OPERATORS.get(name)
            if operator is None:
                raise CommandError(
                    168, f"Unrecognized expression '{name}'", "InvalidPipelineOperator"
                )
            return operator(args, root, variables)
        # An object expression: fields that evaluate to missing are left out
        # (ExpressionObject::evaluate).
        out = {}
        for field, sub in expr.items():
            value = evaluate(sub, root, variables)
            if value is not MISSING:
                out[field] = value
        return out
    return expr


def _missing_to_null(value: Any) -> Any:
    # ExpressionArray::evaluate: a missing element becomes null.
    return None if value is MISSING else value


def _args(args: Any, root: dict, variables: dict) -> list:
    return [evaluate(a, root, variables) for a in (args if isinstance(args, list) else [args])]


def _filter_or_map(kind: str):
    # ExpressionFilter / ExpressionMap::evaluate: a nullish input gives null; a
    # non-array input is error 28651 / 16883.
    def operator(spec: dict, root: dict, variables: dict) -> Any:
        source = evaluate(spec["input"], root, variables)
        if nullish(source):
            return None
        if not isinstance(source, list):
            raise CommandError(28651, f"input to ${kind} must be an array not {source!r}")
        name = spec.get("as", "this")
        out = []
        for item in source:
            scope = {**variables, name: item}
            if kind == "filter":
                if truthy(evaluate(spec["cond"], root, scope)):
                    out.append(item)
            else:
                out.append(_missing_to_null(evaluate(spec["in"], root, scope)))
        return out

    return operator


def _if_null(args, root, variables):
    # ExpressionIfNull: the first argument that is not nullish, else the last.
    values = _args(args, root, variables)
    for value in values[:-1]:
        if not nullish(value):
            return value
    return values[-1]


def _cond(args, root, variables):
    if isinstance(args, dict):
        args = [args["if"], args["then"], args["else"]]
    test, then, otherwise = args
    return evaluate(then if truthy(evaluate(test, root, variables)) else otherwise, root, variables)


def _size(args, root, variables):
    # ExpressionSize::evaluate: uassert 17124 for a non-array.
    [value] = _args(args, root, variables)
    if not isinstance(value, list):
        kind = "missing" if value is MISSING else type(value).__name__
        raise CommandError(
            17124, f"The argument to $size must be an array. Type of argument was: {kind}"
        )
    return len(value)


def _comparison(test):
    # ExpressionCompare: full Value::compare, missing included.
    def operator(args, root, variables):
        a, b = _args(args, root, variables)
        return test(compare(a, b))

    return operator


def _in(args, root, variables):
    # ExpressionIn::evaluate: uassert 40081 when the second argument is not an array.
    value, array = _args(args, root, variables)
    if not isinstance(array, list):
        raise CommandError(40081, "$in requires an array as a second argument")
    return any(compare(value, item) == 0 for item in array)


def _add(args, root, variables):
    # ExpressionAdd: nullish -> null; at most one date, the result is then a date.
    values = _args(args, root, variables)
    if any(nullish(v) for v in values):
        return None
    dates = [v for v in values if isinstance(v, datetime.datetime)]
    total = sum(v for v in values if not isinstance(v, datetime.datetime))
    if len(dates) > 1:
        raise CommandError(16612, "only one date allowed in an $add expression")
    if dates:
        return dates[0] + datetime.timedelta(milliseconds=total)
    return total


def _subtract(args, root, variables):
    # ExpressionSubtract: date - date = milliseconds (long); date - number = date.
    a, b = _args(args, root, variables)
    if nullish(a) or nullish(b):
        return None
    if isinstance(a, datetime.datetime) and isinstance(b, datetime.datetime):
        return Int64(round((a - b).total_seconds() * 1000))
    if isinstance(a, datetime.datetime):
        return a - datetime.timedelta(milliseconds=b)
    return a - b


def _multiply(args, root, variables):
    values = _args(args, root, variables)
    if any(nullish(v) for v in values):
        return None
    product = 1
    for value in values:
        product *= value
    return Int64(product) if isinstance(product, int) and abs(product) >= 2**31 else product


def _max(args, root, variables):
    # ExpressionFromAccumulator<AccumulatorMax>: nullish values are ignored; null if none.
    values = [v for v in _args(args, root, variables) if not nullish(v)]
    if not values:
        return None
    best = values[0]
    for value in values[1:]:
        if compare(value, best) > 0:
            best = value
    return best


def _to_long(args, root, variables):
    # ExpressionConvert to long: a date gives its milliseconds since the epoch.
    [value] = _args(args, root, variables)
    if nullish(value):
        return None
    if isinstance(value, datetime.datetime):
        return Int64(round(value.timestamp() * 1000))
    return Int64(int(value))


def _concat_arrays(args, root, variables):
    # ExpressionConcatArrays: nullish -> null; uassert 28664 for a non-array.
    values = _args(args, root, variables)
    if any(nullish(v) for v in values):
        return None
    out = []
    for value in values:
        if not isinstance(value, list):
            raise CommandError(28664, "$concatArrays only supports arrays")
        out.extend(value)
    return out


def _merge_objects(args, root, variables):
    # ExpressionMergeObjects: nullish arguments are skipped; later fields win.
    out: dict = {}
    for value in _args(args, root, variables):
        if nullish(value):
            continue
        if not isinstance(value, dict):
            raise CommandError(40400, "$mergeObjects requires object inputs")
        out.update(value)
    return out


def _type(args, root, variables):
    # ExpressionType::evaluate: the alias of the value's BSON type (typeName in
    # src/mongo/bson/bsontypes.cpp), "missing" for a value that is not there.
    [value] = _args(args, root, variables)
    if value is MISSING:
        return "missing"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, Int64) or (isinstance(value, int) and not -(2**31) <= value < 2**31):
        return "long"
    names = {
        int: "int",
        float: "double",
        str: "string",
        dict: "object",
        list: "array",
        bytes: "binData",
        ObjectId: "objectId",
        datetime.datetime: "date",
    }
    for kind, name in names.items():
        if isinstance(value, kind):
            return name
    raise CommandError(2, f"stand-in: no type name for {value!r}", "BadValue")


def _object_to_array(args, root, variables):
    # ExpressionObjectToArray::evaluate: nullish -> null; a non-document is error 40390;
    # else one {k, v} per field, in order.
    [value] = _args(args, root, variables)
    if nullish(value):
        return None
    if not isinstance(value, dict):
        raise CommandError(40390, "$objectToArray requires a document input", "Location40390")
    return [{"k": name, "v": item} for name, item in value.items()]


def _not(args, root, variables):
    [value] = _args(args, root, variables)
    return not truthy(value)


OPERATORS = {
    "$literal": lambda args, root, variables: args,
    "$filter": _filter_or_map("filter"),
    "$map": _filter_or_map("map"),
    "$ifNull": _if_null,
    "$cond": _cond,
    "$size": _size,
    "$gt": _comparison(lambda c: c > 0),
    "$lt": _comparison(lambda c: c < 0),
    "$gte": _comparison(lambda c: c >= 0),
    "$lte": _comparison(lambda c: c <= 0),
    "$type": _type,
    "$objectToArray": _object_to_array,
    "$eq": _comparison(lambda c: c == 0),
    "$ne": _comparison(lambda c: c != 0),
    "$not": _not,
    "$and": lambda args, root, variables: all(truthy(v) for v in _args(args, root, variables)),
    "$or": lambda args, root, variables: any(truthy(v) for v in _args(args, root, variables)),
    "$in": _in,
    "$add": _add,
    "$subtract": _subtract,
    "$multiply": _multiply,
    "$max": _max,
    "$toLong": _to_long,
    "$concatArrays": _concat_arrays,
    "$mergeObjects": _merge_objects,
}


# --- queries: src/mongo/db/matcher -------------------------------------------------------


def matches(doc: dict, query: dict, variables: dict) -> bool:
    for field, condition in query.items():
        if field == "$expr":  # ExprMatchExpression: the expression's truth
            if not truthy(evaluate(condition, doc, variables)):
                return False
            continue
        if field.startswith("$"):
            raise CommandError(2, f"stand-in: unsupported query operator {field}", "BadValue")
        value = get_path(doc, field)
        if isinstance(condition, dict) and condition and next(iter(condition)).startswith("$"):
            for name, operand in condition.items():
                if not _query_operator(name, value, operand):
                    return False
        elif not _equal(value, condition):
            return False
    return True


def _equal(value: Any, operand: Any) -> bool:
    # EqualityMatchExpression: {f: null} also matches a document without f.
    if operand is None:
        return nullish(value)
    return value is not MISSING and compare(value, operand) == 0


def _query_operator(name: str, value: Any, operand: Any) -> bool:
    # ComparisonMatchExpression: only values of the operand's canonical type match
    # ("type bracketing"); $in is equality with any element.
    if name == "$in":
        return any(_equal(value, item) for item in operand)
    if name == "$eq":
        return _equal(value, operand)
    if name == "$exists":  # ExistsMatchExpression: whether the path names a value
        return (value is not MISSING) == truthy(operand)
    if value is MISSING or _rank(value) != _rank(operand):
        return False
    c = compare(value, operand)
    tests = {"$gt": c > 0, "$gte": c >= 0, "$lt": c < 0, "$lte": c <= 0}
    if name not in tests:
        raise CommandError(2, f"stand-in: unsupported query operator {name}", "BadValue")
    return tests[name]


# --- pipelines: src/mongo/db/pipeline/document_source_*.cpp ----------------------------


def set_path(doc: dict, path: str, value: Any) -> None:
    """$set/$addFields with a dotted path sets a field of an embedded document,
    creating it (document_source_add_fields.cpp -> projection_executor)."""
    *parents, last = path.split(".")
    for part in parents:
        child = doc.get(part)
        if not isinstance(child, dict):
            child = doc[part] = {}
        doc = child
    if value is MISSING:
        doc.pop(last, None)
    else:
        doc[last] = value


def unset_path(doc: dict, path: str) -> None:
    *parents, last = path.split(".")
    for part in parents:
        doc = doc.get(part)
        if not isinstance(doc, dict):
            return
    doc.pop(last, None)


def run_stage(stage: dict, doc: dict, variables: dict) -> dict:
    [(name, spec)] = stage.items()
    if name in ("$set", "$addFields"):
        # Every field's expression sees the document as it was before the stage.
        values = {path: evaluate(sub, doc, variables) for path, sub in spec.items()}
        out = _copy(doc)
        for path, value in values.items():
            set_path(out, path, value)
        return out
    if name == "$unset":
        out = _copy(doc)
        for path in [spec] if isinstance(spec, str) else spec:
            unset_path(out, path)
        return out
    if name == "$project":
        out = {"_id": doc["_id"]} if spec.get("_id", 1) else {}
        for path, sub in spec.items():
            if path == "_id":
                continue
            if sub in (1, True) and _crosses_array(doc, path):
                raise CommandError(2, f"stand-in: projecting {path!r} through an array", "BadValue")
            value = get_path(doc, path) if sub in (1, True) else evaluate(sub, doc, variables)
            if value is not MISSING:
                set_path(out, path, value)
        return out
    raise CommandError(40324, f"Unrecognized pipeline stage name: '{name}'", "Location40324")


def _crosses_array(doc: Any, path: str) -> bool:
    """Whether a dotted path steps into an array, where the server projects every
    element's field (not implemented here, so refused rather than answered wrongly)."""
    for part in path.split(".")[:-1]:
        doc = doc.get(part) if isinstance(doc, dict) else None
        if isinstance(doc, list):
            return True
    return False


def _copy(doc: dict) -> dict:
    return bson.decode(bson.encode(doc, codec_options=CODEC), codec_options=CODEC)


def apply_modifiers(doc: dict, update: dict, inserting: bool) -> dict:
    """An update document of modifiers (``{$set: ..., $inc: ...}``), as
    src/mongo/db/update/update_object_node.cpp applies them to a copy of ``doc``:
    ``$set`` sets each path, creating documents on the way (set_node.cpp); ``$unset``
    removes it (unset_node.cpp); ``$inc`` adds to a number, a missing field counting as 0
    and anything else refused with TypeMismatch (arithmetic_node.cpp);
    ``$setOnInsert`` sets only when the upsert inserts (it is a no-op on a match). Any
    other modifier is refused, as modifier_table.cpp refuses an unknown one."""
    out = _copy(doc)
    for modifier, fields in update.items():
        if modifier == "$set" or (modifier == "$setOnInsert" and inserting):
            for path, value in fields.items():
                set_path(out, path, value)
        elif modifier == "$setOnInsert":
            continue
        elif modifier == "$unset":
            for path in fields:
                unset_path(out, path)
        elif modifier == "$inc":
            for path, amount in fields.items():
                current = get_path(out, path)
                current = 0 if current is MISSING else current
                if isinstance(current, bool) or not isinstance(current, (int, float)):
                    raise CommandError(
                        14,
                        f"Cannot apply $inc to a value of non-numeric type. {{_id: "
                        f"{out.get('_id')!r}}} has the field '{path}' of non-numeric type",
                        "TypeMismatch",
                    )
                set_path(out, path, current + amount)
        else:
            raise CommandError(
                9,
                f"Unknown modifier: {modifier}. Expected a valid update modifier or "
                "pipeline-style update specified as an array",
                "FailedToParse",
            )
    return out


def project(doc: dict, fields: dict | None) -> dict:
    if not fields:
        return doc
    return run_stage({"$project": fields}, doc, {})


# --- the server ---------------------------------------------------------------------------


class Store:
    """The data, one lock for all of it: each command is atomic."""

    def __init__(self, ttl_monitor_sleep: float = 60.0) -> None:
        self.databases: dict[str, dict[str, dict[Any, dict]]] = {}
        #: (db, collection) -> {index name: its spec}, the _id index left out
        self.indexes: dict[tuple[str, str], dict[str, dict]] = {}
        #: (db, collection) -> {field: expireAfterSeconds}
        self.ttl_indexes: dict[tuple[str, str], dict[str, float]] = {}
        self.lock = threading.Lock()
        #: src/mongo/db/ttl/ttl.idl: ttlMonitorSleepSecs, default 60 (TTLMonitor::run
        #: sleeps that long between passes).
        self.ttl_monitor_sleep = ttl_monitor_sleep

    def collection(self, db: str, name: str) -> dict[Any, dict]:
        return self.databases.setdefault(db, {}).setdefault(name, {})

    def ttl_pass(self) -> int:
        """One pass of src/mongo/db/ttl/ttl.cpp's TTLMonitor: for each TTL index, delete
        the documents whose indexed value lies in [the dawn of time, now -
        expireAfterSeconds] (_deleteExpiredWithIndex, safeExpirationDate: both ends
        included). Only dates fall in those bounds, so a document whose field is not a
        date is never deleted; an array of dates is indexed once per element, so its
        earliest date decides."""
        now = _now()
        deleted = 0
        with self.lock:
            for (db, name), fields in self.ttl_indexes.items():
                docs = self.collection(db, name)
                for key in list(docs):
                    for field, after in fields.items():
                        value = get_path(docs[key], field)
                        cutoff = now - datetime.timedelta(seconds=after)
                        dates = value if isinstance(value, list) else [value]
                        if any(isinstance(d, datetime.datetime) and d <= cutoff for d in dates):
                            del docs[key]
                            deleted += 1
                            break
        return deleted


def _now() -> datetime.datetime:
    """$$NOW: one value per command (src/mongo/db/pipeline/variables.cpp, kNowId, set
    once per operation), with BSON's millisecond precision."""
    now = datetime.datetime.now(tz=datetime.timezone.utc)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


_connection_ids = itertools.count(1)


class Commands:
    def __init__(self, store: Store) -> None:
        self.store = store

    def run(self, body: dict) -> dict:
        name = next(iter(body))
        handler = getattr(self, "cmd_" + name.lower(), None)
        if handler is None:
            raise CommandError(59, f"no such command: '{name}'", "CommandNotFound")
        if name.lower() in ("hello", "ismaster", "ping", "buildinfo", "endsessions", "killcursors"):
            return handler(body)
        with self.store.lock:
            return handler(body)

    # Handshake: src/mongo/db/repl/hello/hello_response.cpp (fields the driver reads).
    def cmd_hello(self, body: dict) -> dict:
        return {
            "helloOk": True,
            "isWritablePrimary": True,
            "ismaster": True,
            "maxBsonObjectSize": 16 * 1024 * 1024,
            "maxMessageSizeBytes": 48_000_000,
            "maxWriteBatchSize": 100_000,
            "localTime": _now(),
            "connectionId": next(_connection_ids),
            "minWireVersion": 0,
            "maxWireVersion": 17,  # MongoDB 6.0
            "readOnly": False,
            "ok": 1.0,
        }

    cmd_ismaster = cmd_hello

    def cmd_ping(self, body: dict) -> dict:
        return {"ok": 1.0}

    def cmd_buildinfo(self, body: dict) -> dict:
        return {"version": "6.0.0-stand-in", "versionArray": [6, 0, 0, 0], "ok": 1.0}

    def cmd_endsessions(self, body: dict) -> dict:
        return {"ok": 1.0}

    def cmd_killcursors(self, body: dict) -> dict:
        return {"cursorsKilled": body.get("cursors", []), "ok": 1.0}

    def cmd_createindexes(self, body: dict) -> dict:
        """An index asked for again as it is changes nothing. The same key under another
        name, or the same name with other options, is IndexOptionsConflict (85); the same
        name on another key, IndexKeySpecsConflict (86): mongodb/mongo's
        jstests/core/ddl/create_index_same_spec_different_name.js and create_indexes.js.
        A TTL index has one field (ttl.cpp, getValidTTLIndex)."""
        where = (body["$db"], body["createIndexes"])
        indexes = self.store.indexes.setdefault(where, {})
        before = 1 + len(indexes)
        for index in body["indexes"]:
            spec = {k: v for k, v in index.items() if k not in ("v", "background")}
            name, key = spec["name"], dict(spec["key"])
            for other_name, other in indexes.items():
                same_key = dict(other["key"]) == key
                if other_name == name and same_key and other == spec:
                    break
                if other_name == name and not same_key:
                    raise CommandError(
                        86,
                        f"An existing index has the same name as the requested index but "
                        f"a different key. Requested index: {spec}, existing index: {other}",
                        "IndexKeySpecsConflict",
                    )
                if same_key:
                    raise CommandError(
                        85,
                        f"An equivalent index already exists with a different name and "
                        f"options. Requested index: {spec}, existing index: {other}",
                        "IndexOptionsConflict",
                    )
            else:
                indexes[name] = spec
                if "expireAfterSeconds" in spec and len(key) == 1:
                    [field] = key
                    self.store.ttl_indexes.setdefault(where, {})[field] = float(
                        spec["expireAfterSeconds"]
                    )
        self.store.collection(*where)
        return {"numIndexesBefore": before, "numIndexesAfter": 1 + len(indexes), "ok": 1.0}

    def cmd_find(self, body: dict) -> dict:
        docs = self.store.collection(body["$db"], body["find"])
        variables = {"NOW": _now(), "REMOVE": REMOVE}
        found = [d for d in docs.values() if matches(d, body.get("filter", {}), variables)]
        if body.get("sort"):
            found = _sort(found, body["sort"])
        if body.get("limit"):
            found = found[: abs(int(body["limit"]))]
        batch = [project(d, body.get("projection")) for d in found]
        return _cursor(body, body["find"], batch)

    def cmd_aggregate(self, body: dict) -> dict:
        docs = list(self.store.collection(body["$db"], body["aggregate"]).values())
        variables = {"NOW": _now(), "REMOVE": REMOVE}
        for stage in body["pipeline"]:
            [(name, spec)] = stage.items()
            if name == "$match":
                docs = [d for d in docs if matches(d, spec, variables)]
            elif name == "$sort":
                docs = _sort(docs, spec)
            elif name == "$limit":
                # src/mongo/db/pipeline/document_source_limit.cpp: passes on the first
                # ``limit`` documents; a limit that is not a positive number is refused
                # (codes 15957 and 15958).
                if not isinstance(spec, (int, float)) or isinstance(spec, bool):
                    raise CommandError(
                        15957, "the limit must be specified as a number", "Location15957"
                    )
                if spec <= 0:
                    raise CommandError(15958, "the limit must be positive", "Location15958")
                docs = docs[: int(spec)]
            else:
                docs = [run_stage(stage, d, variables) for d in docs]
        return _cursor(body, body["aggregate"], docs)

    def cmd_update(self, body: dict) -> dict:
        docs = self.store.collection(body["$db"], body["update"])
        n = modified = 0
        upserted, errors = [], []
        for index, spec in enumerate(body["updates"]):
            try:
                matched, changed, new_id = self._update(docs, spec)
            except CommandError as exc:
                errors.append({"index": index, "code": exc.code, "errmsg": exc.message})
                if body.get("ordered", True):
                    break
                continue
            n += matched or (1 if new_id is not MISSING else 0)
            modified += changed
            if new_id is not MISSING:
                upserted.append({"index": index, "_id": new_id})
        reply = {"n": n, "nModified": modified, "ok": 1.0}
        if upserted:
            reply["upserted"] = upserted
        if errors:
            reply["writeErrors"] = errors
        return reply

    def cmd_insert(self, body: dict) -> dict:
        """src/mongo/db/query/write_ops/insert.cpp fixDocumentForInsert: ``_id`` first, an
        ObjectId made for a document without one; the ``_id`` index refuses a second
        document with the same ``_id`` as E11000 (buildDupKeyErrorStatus in
        src/mongo/db/storage/index_entry_comparison.cpp), one write error per document,
        the rest not tried when ``ordered`` (the default)."""
        database, name = body["$db"], body["insert"]
        docs = self.store.collection(database, name)
        inserted, errors = 0, []
        for index, document in enumerate(body["documents"]):
            doc = {"_id": document.get("_id", ObjectId())}
            doc.update((field, value) for field, value in document.items() if field != "_id")
            if doc["_id"] in docs:
                errors.append(
                    {
                        "index": index,
                        "code": 11000,
                        "errmsg": f"E11000 duplicate key error collection: {database}.{name} "
                        f"index: _id_ dup key: {{ _id: {_shown(doc['_id'])} }}",
                    }
                )
                if body.get("ordered", True):
                    break
                continue
            docs[doc["_id"]] = doc
            inserted += 1
        reply = {"n": inserted, "ok": 1.0}
        if errors:
            reply["writeErrors"] = errors
        return reply

    def cmd_delete(self, body: dict) -> dict:
        docs = self.store.collection(body["$db"], body["delete"])
        variables = {"NOW": _now(), "REMOVE": REMOVE}
        n = 0
        for spec in body["deletes"]:
            targets = [k for k, d in docs.items() if matches(d, spec["q"], variables)]
            for key in targets[:1] if spec.get("limit") == 1 else targets:
                del docs[key]
                n += 1
        return {"n": n, "ok": 1.0}

    def cmd_findandmodify(self, body: dict) -> dict:
        docs = self.store.collection(body["$db"], body["findAndModify"])
        spec = {
            "q": body.get("query", {}),
            "u": body["update"],
            "upsert": body.get("upsert", False),
            "multi": False,
        }
        before: dict = {}
        matched, _changed, new_id = self._update(docs, spec, before)
        key = new_id if new_id is not MISSING else before.get("_id", MISSING)
        value = None
        if key is not MISSING:
            value = docs[key] if body.get("new") else before.get("doc")
            value = project(value, body.get("fields")) if value is not None else None
        last_error = {"n": 1 if key is not MISSING else 0, "updatedExisting": bool(matched)}
        if new_id is not MISSING:
            last_error["upserted"] = new_id
        return {"lastErrorObject": last_error, "value": value, "ok": 1.0}

    def _update(self, docs: dict, spec: dict, before: dict | None = None):
        """(matched, modified, upserted _id or MISSING) of one update statement."""
        update = spec["u"]
        if isinstance(update, dict) and not all(name.startswith("$") for name in update):
            raise CommandError(
                9, "stand-in: replacement documents are not implemented", "FailedToParse"
            )
        variables = {"NOW": _now(), "REMOVE": REMOVE}
        query = spec.get("q", {})
        if spec.get("upsert") and _has_expr(query):
            # src/mongo/db/ops/parsed_update.cpp: an upsert's query is parsed without the
            # $expr feature, and the error is reworded to say so.
            raise CommandError(
                224,
                "$expr is not allowed in the query predicate for an upsert",
                "QueryFeatureNotAllowed",
            )
        targets = [k for k, d in docs.items() if matches(d, query, variables)]
        if not spec.get("multi"):
            targets = targets[:1]
        for key in targets:
            doc = docs[key]
            if before is not None:
                before["_id"], before["doc"] = key, doc
            docs[key] = _updated(doc, update, variables, inserting=False)
        if targets or not spec.get("upsert"):
            return len(targets), len(targets), MISSING
        # Upsert: the new document starts from the query's equality fields
        # (src/mongo/db/update/upsert... UpdateDriver::populateDocumentWithQueryFields).
        seed = {
            f: v
            for f, v in query.items()
            if not f.startswith("$")
            and not (isinstance(v, dict) and any(k.startswith("$") for k in v))
        }
        if "_id" not in seed:
            raise CommandError(2, "stand-in: upserts need an _id in the query", "BadValue")
        if seed["_id"] in docs:
            # The _id index refuses the insert. write_ops_exec.cpp
            # shouldRetryDuplicateKeyException retries as an update only when the query
            # is nothing but ANDed equalities on the unique key; ours have $expr.
            only_equalities = set(query) == set(seed)
            if not only_equalities:
                raise CommandError(
                    11000,
                    f"E11000 duplicate key error collection: {spec.get('ns', 'db.coll')} "
                    f"index: _id_ dup key: {{ _id: {seed['_id']!r} }}",
                    "DuplicateKey",
                )
        doc = _updated(dict(seed), update, variables, inserting=True)
        docs[doc["_id"]] = doc
        return 0, 0, doc["_id"]


def _updated(doc: dict, update: Any, variables: dict, inserting: bool) -> dict:
    """``doc`` after an update pipeline (a list of stages) or a document of modifiers."""
    if isinstance(update, dict):
        return apply_modifiers(doc, update, inserting)
    for stage in update:
        doc = run_stage(stage, doc, variables)
    return doc


def _has_expr(query: Any) -> bool:
    if isinstance(query, dict):
        return any(k == "$expr" or _has_expr(v) for k, v in query.items())
    if isinstance(query, list):
        return any(_has_expr(v) for v in query)
    return False


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _sort(docs: list[dict], spec: dict) -> list[dict]:
    import functools

    def order(a: dict, b: dict) -> int:
        for field, direction in spec.items():
            c = compare(get_path(a, field), get_path(b, field))
            if c:
                return c * (1 if direction >= 0 else -1)
        return 0

    return sorted(docs, key=functools.cmp_to_key(order))


def _cursor(body: dict, collection: str, batch: list[dict]) -> dict:
    return {
        "cursor": {"id": Int64(0), "ns": f"{body['$db']}.{collection}", "firstBatch": batch},
        "ok": 1.0,
    }


def _error(exc: CommandError) -> dict:
    return {"ok": 0.0, "errmsg": exc.message, "code": exc.code, "codeName": exc.name}


class _Handler(socketserver.BaseRequestHandler):
    """One client connection: read a message, answer it, until the client leaves."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        commands: Commands = self.server.commands  # type: ignore[attr-defined]
        while True:
            header = _read(sock, 16)
            if header is None:
                return
            length, request_id, _, opcode = struct.unpack("<iiii", header)
            payload = _read(sock, length - 16)
            if payload is None:
                return
            if opcode == OP_QUERY:
                # OP_QUERY: flags, cstring namespace, skip, limit, query.
                end = payload.index(b"\0", 4)
                query = bson.decode(payload[end + 9 :], codec_options=CODEC)
                reply = self._answer(
                    commands, {**query, "$db": payload[4:end].decode().split(".")[0]}
                )
                body = bson.encode(reply, codec_options=CODEC)
                message = struct.pack("<iqii", 0, 0, 0, 1) + body
                sock.sendall(
                    struct.pack("<iiii", 16 + len(message), 0, request_id, OP_REPLY) + message
                )
            elif opcode == OP_MSG:
                body = self._op_msg_body(payload)
                reply = bson.encode(self._answer(commands, body), codec_options=CODEC)
                message = struct.pack("<I", 0) + b"\0" + reply
                sock.sendall(
                    struct.pack("<iiii", 16 + len(message), 0, request_id, OP_MSG) + message
                )
            else:
                return

    @staticmethod
    def _op_msg_body(payload: bytes) -> dict:
        """OP_MSG: flag bits, then sections: kind 0 is the body, kind 1 a document
        sequence (``updates``, ``documents``) folded into the body."""
        position, body, sequences = 4, None, {}
        while position < len(payload):
            kind = payload[position]
            position += 1
            size = struct.unpack_from("<i", payload, position)[0]
            if kind == 0:
                body = bson.decode(payload[position : position + size], codec_options=CODEC)
            else:
                end = payload.index(b"\0", position + 4)
                name = payload[position + 4 : end].decode()
                docs, cursor = [], end + 1
                while cursor < position + size:
                    doc_size = struct.unpack_from("<i", payload, cursor)[0]
                    docs.append(
                        bson.decode(payload[cursor : cursor + doc_size], codec_options=CODEC)
                    )
                    cursor += doc_size
                sequences[name] = docs
            position += size
        return {**body, **sequences}

    @staticmethod
    def _answer(commands: Commands, body: dict) -> dict:
        try:
            return commands.run(body)
        except CommandError as exc:
            return _error(exc)


def _read(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        try:
            chunk = sock.recv(size - len(data))
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class MongoStandIn:
    """The stand-in on a free loopback port, in threads of the test process."""

    def __init__(self, ttl_monitor_sleep: float = 60.0) -> None:
        self.port = free_port()
        self.store = Store(ttl_monitor_sleep)
        self.server = _Server(("127.0.0.1", self.port), _Handler)
        self.server.commands = Commands(self.store)  # type: ignore[attr-defined]
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}"

    def start(self) -> MongoStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._ttl_monitor, daemon=True).start()
        return self

    def _ttl_monitor(self) -> None:
        while not self._stopped.wait(self.store.ttl_monitor_sleep):
            self.store.ttl_pass()

    def stop(self) -> None:
        self._stopped.set()
        self.server.shutdown()
        self.server.server_close()


class RealMongo:
    """The server at MONGODB_URL (``docker compose up -d mongo``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def start(self) -> RealMongo:
        return self

    def stop(self) -> None:
        pass


def start_mongo():
    url = os.environ.get("MONGODB_URL")
    return RealMongo(url).start() if url else MongoStandIn().start()


__all__ = ["MongoStandIn", "RealMongo", "start_mongo", "time"]
