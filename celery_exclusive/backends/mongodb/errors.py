"""The one place a pymongo exception becomes an ExclusiveError (or, for a write whose
answer was lost, a :class:`.LostAnswer` to read back).

Transient (no server selected in time, a network error, a primary stepping down, a
write concern not yet satisfied): :class:`BackendUnavailable`. Permanent (the
password, the role's privileges, TLS, a server too old for update pipelines, a bad
URL): :class:`ConfigurationError` naming what to fix.
"""

from __future__ import annotations

import pymongo.errors as mongo_errors

from ...errors import ConfigurationError, ExclusiveError
from ..readback import LostAnswer

#: Server error codes retrying cannot fix (src/mongo/base/error_codes.yml), with the fix.
_PERMANENT_CODES = {
    18: "check the user, password and authSource in exclusive_backend_url",  # AuthenticationFailed
    13: "grant the user the readWrite role on the store's database",  # Unauthorized
    8000: "check the user, password and authSource in exclusive_backend_url",  # Atlas auth
    # Update pipelines and $$NOW need MongoDB 4.2 or later:
    9: "use MongoDB 4.2 or later (update pipelines, $$NOW)",  # FailedToParse
    14: "use MongoDB 4.2 or later (update pipelines, $$NOW)",  # TypeMismatch
    40324: "use MongoDB 4.2 or later (update pipelines, $$NOW)",  # unrecognized stage
}

_TLS_WORDS = ("certificate", "ssl", "tls")


def translate(exc: BaseException, action: str, backend) -> ExclusiveError:
    if isinstance(exc, (mongo_errors.ConfigurationError, mongo_errors.InvalidURI)):
        return _refused(exc, action, backend, "fix exclusive_backend_url")
    if isinstance(exc, mongo_errors.OperationFailure) and exc.code in _PERMANENT_CODES:
        return _refused(exc, action, backend, _PERMANENT_CODES[exc.code])
    if isinstance(exc, mongo_errors.ServerSelectionTimeoutError) and any(
        word in str(exc).lower() for word in _TLS_WORDS
    ):
        return _refused(exc, action, backend, "check tls, tlsCAFile and tlsCertificateKeyFile")
    if isinstance(exc, (mongo_errors.ConnectionFailure, mongo_errors.WriteConcernError)):
        return backend.unavailable(action, exc)
    if isinstance(exc, mongo_errors.OperationFailure) and exc.code in (
        10107,  # NotWritablePrimary: a failover is under way
        11600,  # InterruptedAtShutdown
        189,  # PrimarySteppedDown
        91,  # ShutdownInProgress
        64,  # WriteConcernFailed
        262,  # ExceededTimeLimit
    ):
        return backend.unavailable(action, exc)
    if isinstance(exc, mongo_errors.PyMongoError):
        return _refused(exc, action, backend, "check the server's version (4.2 or later)")
    return backend.unavailable(action, exc)


def translate_write(exc: BaseException, action: str, backend) -> Exception:
    """:func:`translate` for a write: a :class:`.LostAnswer` when the request went out
    and no answer came (not for a server that could not even be selected: nothing was
    sent), to be settled by reading back."""
    error = translate(exc, action, backend)
    sent = isinstance(exc, (mongo_errors.AutoReconnect, mongo_errors.WriteConcernError))
    if sent and not isinstance(exc, mongo_errors.ServerSelectionTimeoutError):
        return LostAnswer(error)
    return error


def _refused(exc: BaseException, action: str, backend, fix: str) -> ConfigurationError:
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return ConfigurationError(
        f"the MongoDB store at {backend.safe_url} refused {action} "
        f"({type(exc).__name__}: {text}): {fix}."
    )
