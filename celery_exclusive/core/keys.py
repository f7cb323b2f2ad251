"""Turning a call's arguments into the key its lease is taken on.

A key that cannot be built is an error naming the task and the argument. It never
falls back to something coarser such as the bare task name: that would silently
turn a per-invoice lock into one global lock.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import hashlib
import inspect
import json
import string
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Union

from ..errors import ExclusiveKeyError

#: Keys longer than this are hashed so they stay cheap to store and send.
MAX_KEY_LENGTH = 200

KeySpec = Union[None, str, Sequence[str], Callable[[tuple, dict], str]]


#: A str as compact JSON writes it (what ``json.dumps(text)`` returns, without its
#: per-call checks of options).
_json_str: Callable[[str], str] = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def build_key(
    task_name: str, function: Callable, spec: KeySpec, args: Sequence[Any], kwargs: Mapping
) -> str:
    """The lease key (without the store prefix) for calling ``function(*args, **kwargs)``.

    ``spec`` is what the user wrote as ``exclusive_key``:

    - ``None``: the task name plus every bound argument, defaults applied, so that
      ``settle(7)`` and ``settle(invoice_id=7)`` share a key (see :func:`canonical_text`).
    - a format string such as ``"invoice:{invoice_id}"``, filled from the bound
      arguments. It is used as written: two tasks with the same format string
      exclude each other, which is how to serialise different tasks on one record.
    - a list of argument names: the task name plus those arguments.
    - a callable ``(args, kwargs) -> str``.

    A call that does not match the function's signature raises the TypeError calling
    the function would raise, before any key is built: the caller sees the same error
    with and without exclusion. A key that cannot be built, or that is not text every
    store can keep (see :func:`stored_text`), raises ExclusiveKeyError.
    """
    arguments = _bind(task_name, function, args, kwargs)
    return stored_text(task_name, _build(task_name, spec, args, kwargs, arguments), arguments)


class KeyBinder:
    """The keys of one task's calls, as :func:`build_key` builds them, with what depends
    only on the task worked out once: its signature's parameters and defaults, and the
    check of a format string. A call that the quick binding cannot take as it is (a
    missing or unknown argument, ``*args``, keyword-only parameters) goes through
    :func:`build_key`, so every error is the same.
    """

    __slots__ = ("task_name", "function", "spec", "_names", "_defaults", "_quick")

    def __init__(self, task_name: str, function: Callable, spec: KeySpec) -> None:
        self.task_name, self.function, self.spec = task_name, function, spec
        self._names: tuple[str, ...] = ()
        self._defaults: dict[str, Any] = {}
        self._quick = False
        try:
            parameters = _signature(function).parameters.values()
            if isinstance(spec, str):
                _format_fields(task_name, spec)  # a bad one raises on every call instead
        except (TypeError, ValueError, ExclusiveKeyError):
            return
        if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters):
            self._names = tuple(p.name for p in parameters)
            self._defaults = {
                p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty
            }
            self._quick = spec is None or isinstance(spec, (str, list, tuple))

    def __call__(self, args: Sequence[Any], kwargs: Mapping) -> str:
        arguments = self._bound(args, kwargs) if self._quick else None
        if arguments is None:
            return build_key(self.task_name, self.function, self.spec, args, kwargs)
        spec = self.spec
        if spec is None:
            key = _canonical(self.task_name, arguments)
        elif isinstance(spec, str):
            key = _format(self.task_name, spec, arguments, checked=True)
        else:
            key = _build(self.task_name, spec, args, kwargs, arguments)
        return stored_text(self.task_name, key, arguments)

    def _bound(self, args: Sequence[Any], kwargs: Mapping) -> Optional[dict[str, Any]]:
        """The arguments by name in the signature's order, defaults applied, as
        ``Signature.bind`` gives them; None where that would raise."""
        names = self._names
        given = len(args)
        if given > len(names):
            return None
        arguments = dict(zip(names, args))
        used = 0
        for name in names[given:]:
            if name in kwargs:
                arguments[name] = kwargs[name]
                used += 1
            elif name in self._defaults:
                arguments[name] = self._defaults[name]
            else:
                return None
        return arguments if used == len(kwargs) else None


def _build(
    task_name: str, spec: KeySpec, args: Sequence[Any], kwargs: Mapping, arguments: dict
) -> str:
    if callable(spec):
        return _from_callable(task_name, spec, args, kwargs)
    if spec is None:
        return _canonical(task_name, arguments)
    if isinstance(spec, str):
        return _format(task_name, spec, arguments)
    if isinstance(spec, (list, tuple)):
        missing = [name for name in spec if name not in arguments]
        if missing:
            raise ExclusiveKeyError(
                f"{task_name}: exclusive_key names the argument {missing[0]!r}, which the task "
                f"does not take (it takes: {', '.join(arguments) or 'nothing'}).",
                task_name,
                missing[0],
            )
        return _canonical(task_name, {name: arguments[name] for name in spec})
    raise ExclusiveKeyError(
        f"{task_name}: exclusive_key must be a format string, a list of argument names or a "
        f"callable (args, kwargs) -> str, not {type(spec).__name__}.",
        task_name,
    )


def stored_text(task_name: str, key: str, arguments: Optional[Mapping[str, Any]] = None) -> str:
    """``key``, if every store can keep it: text UTF-8 can encode.

    A lone surrogate (``"\\ud800"``) is no character: it comes from bytes decoded with
    ``errors="surrogateescape"`` (``os.fsdecode``, ``sys.argv``, file names) or from a
    JSON ``\\ud800`` escape, and not every store can keep it. The default key writes
    arguments as JSON, which escapes it; a format string or a callable puts it in the
    key as it is, and the call is refused here, naming the argument that holds it.
    """
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        culprit = next(
            (
                name
                for name, value in (arguments or {}).items()
                if isinstance(value, str) and not is_storable(value)
            ),
            None,
        )
        where = f"argument {culprit!r}" if culprit else "the key"
        raise ExclusiveKeyError(
            f"{task_name}: the lease key {key!r} cannot be stored: {where} holds "
            f"{exc.object[exc.start : exc.end]!r}, a lone surrogate, which is not text "
            "(UTF-8 cannot encode it). It comes from bytes decoded with "
            "errors='surrogateescape' (os.fsdecode, sys.argv) or from a JSON \\ud800 "
            "escape: decode such bytes with errors='replace', or key on their repr().",
            task_name,
            culprit,
        ) from None
    return key


def is_storable(text: str) -> bool:
    """Whether every store can keep ``text``: UTF-8 can encode it (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_key_spec(task_name: str, function: Callable, spec: KeySpec) -> None:
    """Catch a key that can never be built before any call is made (at worker start)."""
    if spec is None or callable(spec):
        return
    if isinstance(spec, str):
        stored_text(task_name, spec)
    names = _parameter_names(function)
    if names is None:
        return
    fields = _format_fields(task_name, spec) if isinstance(spec, str) else list(spec)
    unknown = [f for f in fields if f not in names]
    if unknown:
        raise ExclusiveKeyError(
            f"{task_name}: exclusive_key {spec!r} refers to {unknown[0]!r}, which is not an "
            f"argument of the task (its arguments: {', '.join(names) or 'none'}).",
            task_name,
            unknown[0],
        )


@functools.lru_cache(maxsize=1024)
def _signature(function: Callable) -> inspect.Signature:
    """Signatures never change, and inspecting one costs more than the rest of a key."""
    return inspect.signature(function)


def _bind(task_name: str, function: Callable, args: Sequence, kwargs: Mapping) -> dict[str, Any]:
    try:
        signature = _signature(function)
    except (TypeError, ValueError):
        # No introspectable signature: key on what was passed, positionally and by name.
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        # What calling the function would raise; Celery's own argument check (and a
        # plain task's run) raises the same type, so callers catch one thing.
        name = getattr(function, "__name__", task_name)
        raise TypeError(f"{name}() {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _parameter_names(function: Callable) -> list[str] | None:
    try:
        return list(_signature(function).parameters)
    except (TypeError, ValueError):
        return None


def _format_fields(task_name: str, spec: str) -> list[str]:
    try:
        parsed = list(string.Formatter().parse(spec))
    except ValueError as exc:
        raise ExclusiveKeyError(
            f"{task_name}: exclusive_key {spec!r} is not a valid format string: {exc}.", task_name
        ) from None
    fields = []
    for _, field, _, _ in parsed:
        if field is not None:
            name = field.split(".")[0].split("[")[0]
            if not name or name.isdigit():
                raise ExclusiveKeyError(
                    f"{task_name}: exclusive_key {spec!r} must name arguments, as in "
                    f"'invoice:{{invoice_id}}', not use positional fields.",
                    task_name,
                )
            fields.append(name)
    return fields


def _format(task_name: str, spec: str, arguments: Mapping[str, Any], checked: bool = False) -> str:
    """``spec`` filled from ``arguments`` (``checked``: its fields already were)."""
    if not checked:
        _format_fields(task_name, spec)
    try:
        return spec.format_map(arguments)
    except (KeyError, AttributeError, IndexError) as exc:
        field = exc.args[0] if exc.args else "?"
        raise ExclusiveKeyError(
            f"{task_name}: exclusive_key {spec!r} refers to {field!r}, which this call does not "
            f"provide (arguments: {', '.join(arguments) or 'none'}).",
            task_name,
            str(field),
        ) from None


def _from_callable(task_name: str, spec: Callable, args: Sequence, kwargs: Mapping) -> str:
    try:
        key = spec(tuple(args), dict(kwargs))
    except Exception as exc:
        raise ExclusiveKeyError(
            f"{task_name}: the exclusive_key callable raised {type(exc).__name__}: {exc}.",
            task_name,
        ) from exc
    if not isinstance(key, str) or not key:
        raise ExclusiveKeyError(
            f"{task_name}: the exclusive_key callable must return a non-empty str, "
            f"it returned {key!r}.",
            task_name,
        )
    return key


def _canonical(task_name: str, arguments: Mapping[str, Any]) -> str:
    """``task_name:`` plus the canonical text of the arguments; hashed when long."""
    encoded = {}
    for name, value in arguments.items():
        try:
            encoded[name] = canonical_text(value)
        except TypeError as exc:
            raise ExclusiveKeyError(
                f"{task_name}: cannot build the lease key from argument {name!r}: {exc}. "
                "Name the arguments that identify the work with exclusive_key.",
                task_name,
                name,
            ) from None
    body = "{" + ",".join(f"{_json_str(name)}:{encoded[name]}" for name in sorted(encoded)) + "}"
    key = f"{task_name}:{body}"
    if len(key) > MAX_KEY_LENGTH:
        key = f"{task_name}:sha256:{hashlib.sha256(body.encode()).hexdigest()}"
    return key


def canonical_text(value: Any) -> str:
    """One text per value, the same wherever the call is made, different for different values.

    JSON values are written as compact JSON with sorted keys. Every other type Celery's
    serializers carry is written as ``tag(JSON)``, which no JSON text can be, so
    ``b"7"``, ``"7"`` and ``7`` get three keys, and so do a date and its ISO string:
    ``bytes("7")`` (bytes, bytearray: one character per byte, 0-255),
    ``datetime("...")``, ``date("...")``, ``time("...")`` (ISO 8601),
    ``timedelta([days,seconds,microseconds])``, ``decimal("1.10")``, ``uuid("...")``,
    ``set([...])`` (a set or frozenset, its items sorted by their text). A value with
    kombu's ``__json__()`` hook is written as what that returns, as kombu sends it.

    Some values arrive in the worker changed by the JSON serializer, and are written
    as they arrive, so that producer and worker agree: a tuple is a list, and a
    mapping's non-string keys are written as JSON writes them (``1`` as ``"1"``).

    A new-style errback, which Celery calls directly as ``errback(request, exc,
    traceback)``, is keyed on the failed task: its request as ``request("<task id>")``
    and its exception as ``exception("<module.Class>","<message>")``.

    Raises TypeError for anything else, such as an arbitrary object sent with pickle:
    such a task names the arguments that identify its work with ``exclusive_key``.
    """
    kind = type(value)
    if kind is str:
        return _json_str(value)
    if kind is int:
        return int.__repr__(value)
    if value is None or isinstance(value, (str, bool, int, float)):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical_text(item) for item in value) + "]"
    if isinstance(value, Mapping):
        items = sorted((_mapping_key(key), canonical_text(item)) for key, item in value.items())
        return "{" + ",".join(f"{json.dumps(key)}:{text}" for key, text in items) + "}"
    reducer = getattr(value, "__json__", None)
    if reducer is not None:
        return canonical_text(reducer())
    for types, tag, text in _TAGGED:
        if isinstance(value, types):
            return f"{tag}({text(value)})"
    raise TypeError(f"{type(value).__name__} has no canonical form")


def _mapping_key(key: Any) -> str:
    """A mapping key as JSON writes it: the JSON serializer delivers ``{1: x}`` as
    ``{"1": x}``. Keys JSON cannot write are written as their canonical text."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return canonical_text(key)


def _sorted_items(items: Any) -> str:
    return "[" + ",".join(sorted(canonical_text(item) for item in items)) + "]"


def _iso(value: Any) -> str:
    return json.dumps(value.isoformat())


def tag_type(types: Any, tag: str, text: Callable[[Any], str]) -> None:
    """Write values of ``types`` as ``tag(text(value))``: for a host's own objects that
    reach a call as arguments (Celery gives a new-style errback its failed task's
    request: :mod:`celery_exclusive.celery.task` tags it ``request``)."""
    global _TAGGED
    if not any(tagged == tag for _, tagged, _ in _TAGGED):
        _TAGGED = ((types, tag, text), *_TAGGED)


#: Types written as ``tag(JSON)``, most specific first (a datetime is also a date).
_TAGGED: tuple[tuple[Any, str, Callable[[Any], str]], ...] = (
    ((bytes, bytearray, memoryview), "bytes", lambda v: json.dumps(bytes(v).decode("latin-1"))),
    (datetime.datetime, "datetime", _iso),
    (datetime.date, "date", _iso),
    (datetime.time, "time", _iso),
    (
        datetime.timedelta,
        "timedelta",
        lambda v: json.dumps([v.days, v.seconds, v.microseconds]),
    ),
    (decimal.Decimal, "decimal", lambda v: json.dumps(str(v))),
    (uuid.UUID, "uuid", lambda v: json.dumps(str(v))),
    ((set, frozenset), "set", _sorted_items),
    (
        BaseException,
        "exception",
        lambda v: (
            f"{json.dumps(f'{type(v).__module__}.{type(v).__qualname__}')},{json.dumps(str(v))}"
        ),
    ),
)
