"""Redis lease store: every operation is one Lua script, one round trip.

Keys for a lease key ``K`` (already namespaced, e.g. ``exclusive:invoice:7``):

``K``             limit 1: a string ``SET NX PX`` holding the holder record (JSON with
                  the owner token). limit > 1: a sorted set owner -> expiry (ms).
``K:~holders``    limit > 1 only: hash owner -> "fencing_token holder-JSON", and
                  ``~limit`` -> the limit the key is held with.
``K:~fence``      the fencing counter, INCRed on every grant. It never expires: a
                  counter that restarted at 1 would let an old writer pass a fence.
``K:~signal``     a short list pushed on release when nobody is in line; waiters
                  BLPOP it. While someone is, release pushes the first in line's own
                  list ``K:~signal:<claimant>`` instead, which every waiter BLPOPs
                  beside ``K:~signal``: the release wakes exactly the one it lets in.
``K:~line``       the key's line (see ``backends/line.py``), a mark; the acquire script
                  admits only its first entries and takes the claimant out of it.
``*:~*``          other marks (pending reruns, enqueue flags): strings with PX ttl.
``R:~record``     the value of record ``R`` (``write_record``), a plain string that
                  never expires, written by a script that first checks the lease.

A mutex and a semaphore on the same key are different Redis types, so contenders
that disagree on the limit get WRONGTYPE, reported as a ConfigurationError.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, Optional
from urllib.parse import parse_qs, urlsplit

import redis
from redis.exceptions import RedisError, ResponseError

from ..errors import ConfigurationError
from .base import Backend, Lease, LeaseInfo
from .line import line_mark

FENCE, HOLDERS, SIGNAL, RECORD = ":~fence", ":~holders", ":~signal", ":~record"
#: Every key the store keeps beside a lease (and every mark) contains this.
MARKER = ":~"

#: Seconds to connect, and to wait for any non-blocking reply.
CONNECT_TIMEOUT, SOCKET_TIMEOUT = 2.0, 5.0
#: A BLPOP never blocks longer than this, so it always returns inside SOCKET_TIMEOUT.
MAX_BLOCK = SOCKET_TIMEOUT - 1.0

# KEYS: K, K:~fence, K:~holders, K:~line   ARGV: owner, ttl_ms, limit, holder JSON,
# claimant ('' for none). The claimant's place in the line (its length if absent) must
# be below the number of free slots; the grant takes the claimant out of the line.
_ACQUIRE = """
local line, position = nil, 0
local raw = redis.call('GET', KEYS[4])
if raw then
  local ok, decoded = pcall(cjson.decode, raw)
  if ok and type(decoded) == 'table' then
    line, position = decoded, #decoded
    for i, entry in ipairs(line) do
      if entry.id == ARGV[5] then
        position = i - 1
        break
      end
    end
  end
end
local function leave_line()
  if line and position < #line then
    table.remove(line, position + 1)
    if #line == 0 then
      redis.call('DEL', KEYS[4])
    else
      local pttl = redis.call('PTTL', KEYS[4])
      redis.call('SET', KEYS[4], cjson.encode(line), 'PX', math.max(pttl, 1))
    end
  end
end
local limit = tonumber(ARGV[3])
if limit == 1 then
  if position > 0 then
    return false
  end
  local record = '{"owner":"' .. ARGV[1] .. '","holder":' .. ARGV[4] .. '}'
  if redis.call('SET', KEYS[1], record, 'NX', 'PX', ARGV[2]) then
    leave_line()
    return redis.call('INCR', KEYS[2])
  end
  if redis.call('TYPE', KEYS[1]).ok ~= 'string' then
    return redis.error_reply('WRONGTYPE limit mismatch')
  end
  return false
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[3], unpack(expired))
end
local held = redis.call('ZCARD', KEYS[1])
if held > 0 and tonumber(redis.call('HGET', KEYS[3], '~limit')) ~= limit then
  return redis.error_reply('WRONGTYPE limit mismatch')
end
if position >= limit - held then
  return false
end
redis.call('HSET', KEYS[3], '~limit', limit)
leave_line()
local token = redis.call('INCR', KEYS[2])
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], token .. ' ' .. ARGV[4])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[3], ttl)
end
return token
"""

# KEYS: for each lease, K and K:~holders.  ARGV: for each lease, owner, ttl_ms, limit.
# Returns the 1-based positions of the leases found lost.
_RENEW = """
local lost = {}
local now = nil
for i = 1, #ARGV / 3 do
  local key, owner = KEYS[2 * i - 1], ARGV[3 * i - 2]
  local ttl, limit = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  if limit == 1 then
    local record = redis.call('GET', key)
    if record and cjson.decode(record).owner == owner then
      redis.call('PEXPIRE', key, ttl)
    else
      table.insert(lost, i)
    end
  else
    if not now then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    local expiry = redis.call('ZSCORE', key, owner)
    if expiry and tonumber(expiry) > now then
      redis.call('ZADD', key, 'XX', now + ttl, owner)
      if redis.call('PTTL', key) < ttl then
        redis.call('PEXPIRE', key, ttl)
        redis.call('PEXPIRE', KEYS[2 * i], ttl)
      end
    else
      table.insert(lost, i)
    end
  end
end
return lost
"""

# KEYS: K, K:~holders, K:~signal, K:~line   ARGV: owner, limit, signal_ttl_ms
_RELEASE = """
local released = 0
if tonumber(ARGV[2]) == 1 then
  local record = redis.call('GET', KEYS[1])
  if record and cjson.decode(record).owner == ARGV[1] then
    redis.call('DEL', KEYS[1])
    released = 1
  end
else
  released = redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
if released == 1 then
  -- Wake the first in line, whom the acquire script lets in, not whoever waited first.
  -- Its list's name is built here: the claimant is only known from the line.
  local signal = KEYS[3]
  local raw = redis.call('GET', KEYS[4])
  if raw then
    local ok, line = pcall(cjson.decode, raw)
    if ok and type(line) == 'table' and line[1] and type(line[1].id) == 'string' then
      signal = KEYS[3] .. ':' .. line[1].id
    end
  end
  redis.call('RPUSH', signal, 1)
  redis.call('LTRIM', signal, -tonumber(ARGV[2]), -1)
  redis.call('PEXPIRE', signal, ARGV[3])
end
return released
"""

# KEYS: K, K:~holders, K:~line   ARGV: claimant ('' for none)
# 1 if a slot of K is free and nobody else is first in its line, else 0.
_FREE_FOR = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'string' then
  return 0
elseif kind == 'zset' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local live = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
  if live >= tonumber(redis.call('HGET', KEYS[2], '~limit') or 1) then
    return 0
  end
end
local raw = redis.call('GET', KEYS[3])
if raw then
  local ok, line = pcall(cjson.decode, raw)
  if ok and type(line) == 'table' and line[1] and line[1].id ~= ARGV[1] then
    return 0
  end
end
return 1
"""

# KEYS: K (the lease key), R:~record   ARGV: owner, limit, value
# Writes the record only if the owner holds K now: the fenced write of write_record().
_WRITE_RECORD = """
local held = false
if tonumber(ARGV[2]) == 1 then
  local record = redis.call('GET', KEYS[1])
  held = record and cjson.decode(record).owner == ARGV[1]
else
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
  held = expiry and tonumber(expiry) > now
end
if not held then
  return 0
end
redis.call('SET', KEYS[2], ARGV[3])
return 1
"""


# KEYS: mark   ARGV: has_expected (0/1), expected, has_new (0/1), new, ttl_ms
_SWAP_MARK = """
local current = redis.call('GET', KEYS[1])
if ARGV[1] == '1' then
  if current ~= ARGV[2] then
    return 0
  end
elseif current then
  return 0
end
if ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
else
  redis.call('DEL', KEYS[1])
end
return 1
"""


def client_from_url(url: str) -> redis.Redis:
    """A client for ``redis://``, ``rediss://`` or ``redis+sentinel://`` URLs.

    Sentinel URLs name the sentinels and the monitored service:
    ``redis+sentinel://[:password@]host:26379[,host2:26379]/service[/db]``.
    """
    timeouts = {"socket_connect_timeout": CONNECT_TIMEOUT, "socket_timeout": SOCKET_TIMEOUT}
    parts = urlsplit(url)
    if parts.scheme != "redis+sentinel":
        return redis.Redis.from_url(url, **timeouts)
    from redis.sentinel import Sentinel

    hosts = []
    for hostport in parts.netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = hostport.partition(":")
        hosts.append((host, int(port or 26379)))
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ConfigurationError(
            f"exclusive_backend_url {url!r} names no Sentinel service; "
            "write redis+sentinel://host:26379/<service>[/db]."
        )
    query = parse_qs(parts.query)
    sentinel = Sentinel(hosts, sentinel_kwargs=dict(timeouts), **timeouts)
    return sentinel.master_for(
        path[0],
        db=int(path[1]) if len(path) > 1 else 0,
        password=parts.password or (query.get("password") or [None])[0],
    )


class RedisBackend(Backend):
    pushes_wakeups = True
    stores_records = True
    stores_marks = True

    def __init__(self, url: str, client: Optional[redis.Redis] = None) -> None:
        super().__init__(url)
        self.client = client if client is not None else client_from_url(url)
        self._acquire = self.client.register_script(_ACQUIRE)
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)
        self._write_record = self.client.register_script(_WRITE_RECORD)
        self._free_for = self.client.register_script(_FREE_FOR)
        self._swap_mark = self.client.register_script(_SWAP_MARK)

    def _call(self, action: str, key: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise ConfigurationError(
                    f"the key {key!r} is held with a different exclusive_limit than the one "
                    "requested; every task sharing a key must use the same limit."
                ) from None
            raise self.unavailable(action, exc) from None
        except RedisError as exc:
            raise self.unavailable(action, exc) from None

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        token = self._call(
            f"acquiring {key!r}",
            key,
            self._acquire,
            keys=[key, key + FENCE, key + HOLDERS, line_mark(key)],
            args=[owner, _ms(ttl), limit, json.dumps(dict(holder or {})), claimant or ""],
        )
        return None if token is None else Lease(key, owner, int(token), ttl, limit)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        keys, args = [], []
        for lease in leases:
            keys += [lease.key, lease.key + HOLDERS]
            args += [lease.owner, _ms(lease.ttl), lease.limit]
        lost = self._call(
            f"renewing {len(leases)} lease(s)", leases[0].key, self._renew, keys=keys, args=args
        )
        return {leases[i - 1] for i in lost}

    def release(self, lease: Lease) -> bool:
        key = lease.key
        return bool(
            self._call(
                f"releasing {key!r}",
                key,
                self._release,
                keys=[key, key + HOLDERS, key + SIGNAL, line_mark(key)],
                args=[lease.owner, lease.limit, _ms(max(lease.ttl, 1.0))],
            )
        )

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        # BLPOP takes whole or fractional seconds; 0 would mean "forever".
        block = min(timeout, MAX_BLOCK)
        action = f"waiting on {key!r}"
        keys = [key, key + HOLDERS, line_mark(key)]
        if block <= 0 or self._call(action, key, self._free_for, keys=keys, args=[claimant or ""]):
            return
        # The first in line is woken on its own list; anyone may be woken on the key's.
        signals = [] if claimant is None else [f"{key}{SIGNAL}:{claimant}"]
        signals.append(key + SIGNAL)
        self._call(action, key, self.client.blpop, signals, block)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        try:
            return [
                info for key in sorted(self._lease_keys(prefix)) for info in self._describe(key)
            ]
        except RedisError as exc:
            raise self.unavailable("listing holders", exc) from None

    def holders_of(self, key: str) -> list[LeaseInfo]:
        try:
            return self._describe(key)
        except RedisError as exc:
            raise self.unavailable(f"reading {key!r}", exc) from None

    def _lease_keys(self, prefix: str) -> set[str]:
        pattern = _glob_escape(prefix) + "*"
        keys = set()
        for raw in self.client.scan_iter(match=pattern, count=1000):
            key = raw.decode() if isinstance(raw, bytes) else raw
            if MARKER not in key:  # fences, signals, records, marks: not leases
                keys.add(key)
        return keys

    def _describe(self, key: str) -> list[LeaseInfo]:
        pipe = self.client.pipeline(transaction=True)
        pipe.type(key).get(key + FENCE).pttl(key)
        kind, fence, pttl = pipe.execute()
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind == "string":
            record = self.client.get(key)
            if record is None:
                return []
            record = json.loads(record)
            return [LeaseInfo(key, record["owner"], _int(fence), _seconds(pttl), record["holder"])]
        if kind != "zset":
            return []
        now_ms = time.time() * 1000
        infos = []
        details = self.client.hgetall(key + HOLDERS)
        for owner, expiry in self.client.zrange(key, 0, -1, withscores=True):
            if expiry <= now_ms:
                continue
            token, _, holder = details.get(owner, b"0 {}").decode().partition(" ")
            infos.append(
                LeaseInfo(
                    key,
                    owner.decode(),
                    int(token),
                    (expiry - now_ms) / 1000,
                    json.loads(holder or "{}"),
                )
            )
        return infos

    def force_release(self, key: str) -> int:
        def force() -> int:
            count = len(self._describe(key))
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key, key + HOLDERS).rpush(key + SIGNAL, 1).pexpire(key + SIGNAL, 30_000)
            pipe.execute()
            return count

        return self._call(f"force-releasing {key!r}", key, force)

    def read_record(self, key: str) -> Optional[str]:
        value = self._call(f"reading the record {key!r}", key, self.client.get, key + RECORD)
        return value.decode() if isinstance(value, bytes) else value

    def write_record(self, lease: Lease, key: str, value: str) -> bool:
        return bool(
            self._call(
                f"writing the record {key!r}",
                lease.key,
                self._write_record,
                keys=[lease.key, key + RECORD],
                args=[lease.owner, lease.limit, value],
            )
        )

    def read_mark(self, name: str) -> Optional[str]:
        value = self._call(f"reading the mark {name!r}", name, self.client.get, name)
        return value.decode() if isinstance(value, bytes) else value

    def swap_mark(self, name: str, expected: Optional[str], new: Optional[str], ttl: float) -> bool:
        args = [
            int(expected is not None),
            expected or "",
            int(new is not None),
            new or "",
            _ms(ttl),
        ]
        return bool(
            self._call(f"changing the mark {name!r}", name, self._swap_mark, keys=[name], args=args)
        )

    def close(self) -> None:
        self.client.close()


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _int(value) -> Optional[int]:
    return None if value is None else int(value)


def _seconds(pttl: int) -> Optional[float]:
    return None if pttl is None or pttl < 0 else pttl / 1000


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
