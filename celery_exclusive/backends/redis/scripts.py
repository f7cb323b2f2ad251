"""The Lua scripts of the Redis store: every operation is one script, one round trip.

Each script opens by binding KEYS and ARGV to named locals and says what it returns.
Names come from :mod:`.layout`; every key a script touches shares the hash slot of one
lease key, so each script runs on one Redis Cluster node. The exceptions,
``swap_mark_and_release`` (which also sets a mark of another key) and
``release_and_write`` (which also writes a key of the application's), run only off
Cluster.

A limit-1 lease is a string, ``<len(owner)>:<owner> <token> <holder JSON>``: the owner
check compares a prefix, so the uncontended path never decodes JSON, and the length
in front makes the prefix of one owner never the prefix of another's record. A
semaphore (limit > 1) is a sorted set owner -> expiry (ms, store time) beside a hash
of each holder's token and record. A mutex and a semaphore on the same key are thus
different Redis types: contenders that disagree on the limit get WRONGTYPE, which the
store reports as a ConfigurationError.
"""

from __future__ import annotations

#: The store's clock. Scripts call it at most once (TIME is not free).
_NOW = """
-- Now by the store's clock, in microseconds since the epoch (exact: below 2^53).
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
"""

#: How a holder of a key is told from anybody else.
_HOLDS = """
-- The prefix a limit-1 lease value starts with when `owner` holds it.
local function owner_prefix(owner)
  return #owner .. ':' .. owner .. ' '
end

-- redis.call, except that a key of the other kind (a mutex held where a semaphore was,
-- or the reverse: the key is held with another limit since) answers false.
local function call_typed(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'WRONGTYPE', 1, true) then
      return false
    end
    error(reply)
  end
  return reply
end

-- Whether `owner` holds the lease `lease_key` now (`now_ms`: for semaphores only).
local function holds(lease_key, owner, limit, now_ms)
  if limit == 1 then
    local value = call_typed('GET', lease_key)
    local prefix = owner_prefix(owner)
    return value ~= false and string.sub(value, 1, #prefix) == prefix
  end
  local expiry = call_typed('ZSCORE', lease_key, owner)
  return expiry ~= false and tonumber(expiry) > now_ms
end
"""

#: The line of waiters, as backends/line.py reads it.
_LINE = """
-- The entries of the line `raw` as stored (nil if none or unreadable), and the ids of
-- those whose `until` (store seconds) is after `now_s`, first first.
local function parse_line(raw, now_s)
  if not raw then
    return nil, {}
  end
  local ok, decoded = pcall(cjson.decode, raw)
  if not ok or type(decoded) ~= 'table' then
    return nil, {}
  end
  local entries, live = {}, {}
  for _, entry in ipairs(decoded) do
    if type(entry) == 'table' and type(entry.id) == 'string' then
      table.insert(entries, entry)
      local until_s = tonumber(entry['until'])
      if until_s and until_s > now_s then
        table.insert(live, entry.id)
      end
    end
  end
  return entries, live
end

-- The same, for the line stored at `line_key`.
local function read_line(line_key, now_s)
  return parse_line(redis.call('GET', line_key), now_s)
end

-- The 0-based place of `claimant` among the `live` ids; #live if it is not there.
local function place_of(live, claimant)
  for i, id in ipairs(live) do
    if id == claimant then
      return i - 1
    end
  end
  return #live
end

-- Take `claimant` out of the line's `entries` (dead ones stay: their waiters drop them).
local function leave_line(line_key, entries, claimant)
  local rest = {}
  for _, entry in ipairs(entries) do
    if entry.id ~= claimant then
      table.insert(rest, entry)
    end
  end
  if #rest == #entries then
    return
  end
  if #rest == 0 then
    redis.call('DEL', line_key)
  else
    local pttl = redis.call('PTTL', line_key)
    redis.call('SET', line_key, cjson.encode(rest), 'PX', math.max(pttl, 1))
  end
end
"""

#: Waking a waiter after a slot is freed.
_WAKE = """
-- Wake whoever may take the freed slot: the first live waiter of the line on its own
-- list (the acquire script admits nobody else), else, if a waiter outside the line
-- blocks (`waiting_key` is set), the key's list; else nobody, and nothing is written.
local function wake(line_key, signal_key, waiting_key, slots, signal_ttl)
  -- Nobody in line and nobody blocking (the uncontended case): one read, no write.
  if redis.call('EXISTS', line_key, waiting_key) == 0 then
    return
  end
  local signal = nil
  if redis.call('EXISTS', line_key) == 1 then
    local _, live = read_line(line_key, now_us() / 1000000)
    if live[1] then
      signal = signal_key .. ':' .. live[1]
    end
  end
  if not signal and redis.call('EXISTS', waiting_key) == 1 then
    signal = signal_key
  end
  if not signal then
    return
  end
  -- A waiter's own list is the one entry a script writes without declaring it. While
  -- a Redis Cluster moves the key's slot, the node refuses an undeclared entry it does
  -- not have, and the release already written would be reported as failed: the first
  -- in line is then woken on the key's list instead, which it blocks on too.
  local pushed = redis.pcall('RPUSH', signal, 1)
  if type(pushed) == 'table' and pushed.err then
    if signal == signal_key then
      error(pushed)
    end
    signal = signal_key
    redis.call('RPUSH', signal, 1)
  end
  redis.call('LTRIM', signal, -slots, -1)
  redis.call('PEXPIRE', signal, signal_ttl)
end
"""

#: How long a key's fence outlives its last grant, beyond the lease's ttl. The token is
#: floored by the store's clock, and a grant's token is its grant time (µs): a later
#: grant's clock reading exceeds it unless the clock stepped back by more than the time
#: between the two grants. So the fence only orders grants within one microsecond or
#: across a backward step of the clock, and is needed only while such a step could still
#: reach back past the last grant; a fence that expired (or was lost) never lets a token
#: go backwards on a clock that steps back less than this. Kept short so that a burst of
#: distinct keys leaves its fences behind for minutes, not a day.
FENCE_TTL_MS = 10 * 60 * 1000

_TOKEN = f"""
-- The next fencing token of a key whose fence holds `last` (false if none): above the
-- last one and never below now (µs), so it keeps rising when the counter is lost
-- (restart, eviction, failover).
local function next_token(last, now)
  return math.max(tonumber(last or '0') + 1, now)
end

-- A token as text (integers below 2^53 format exactly with %d).
local function token_text(token)
  return string.format('%d', token)
end

-- Keep `text` (a token_text) as the key's last token: past the lease's ttl by a margin.
local function keep_token(fence_key, text, ttl)
  redis.call('SET', fence_key, text, 'PX', ttl + {FENCE_TTL_MS})
end
"""

ACQUIRE = (
    _NOW
    + _HOLDS
    + _LINE
    + _TOKEN
    + """
-- Grant a slot of a key if the line lets the caller in.
-- Returns the fencing token of the grant, or false when there is no slot for the caller.
-- Owners are unique per attempt, so a slot the owner already holds can only be this
-- very request, sent again by the client after its answer was lost: that grant is
-- answered again (its token, its ttl from now), never taken for somebody else's.
local lease_key, fence_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, ttl, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local holder, claimant = ARGV[4], ARGV[5]  -- claimant: '' when the caller is not in line

local now = now_us()
-- The line and the fence in one read (entries of one key: one hash slot).
local line, last = unpack(redis.call('MGET', line_key, fence_key))
-- The line is decoded only where there is one: the uncontended path never parses it.
local entries, live = nil, {}
if line then
  entries, live = parse_line(line, now / 1000000)
end
local place = place_of(live, claimant)

if limit == 1 then
  if place == 0 then
    local token = next_token(last, now)
    local text = token_text(token)
    if redis.call('SET', lease_key, owner_prefix(owner) .. text .. ' ' .. holder,
                  'NX', 'PX', ttl) then
      keep_token(fence_key, text, ttl)
      if entries then
        leave_line(line_key, entries, claimant)
      end
      return token
    end
  end
  -- Refused, unless the owner's own earlier send holds the key. (Where SET NX failed
  -- the key exists: read as nothing, it is a semaphore's.)
  local value = call_typed('GET', lease_key)
  if value == false then
    if place == 0 then
      return redis.error_reply('WRONGTYPE limit mismatch')
    end
    return false
  end
  local prefix = owner_prefix(owner)
  if string.sub(value, 1, #prefix) ~= prefix then
    return false
  end
  redis.call('PEXPIRE', lease_key, ttl)
  return tonumber(string.match(value, '^%d+', #prefix + 1))
end

local now_ms = math.floor(now / 1000)
-- A semaphore, on a key nobody holds as a mutex.
local kind = redis.call('TYPE', lease_key).ok
if kind ~= 'zset' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE limit mismatch')
end
local expired = redis.call('ZRANGEBYSCORE', lease_key, '-inf', now_ms)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', lease_key, '-inf', now_ms)
  for i, gone in ipairs(expired) do
    expired[i] = 'h:' .. gone
  end
  redis.call('HDEL', holders_key, unpack(expired))
end
local held = redis.call('ZCARD', lease_key)
if held > 0 and tonumber(redis.call('HGET', holders_key, 'limit')) ~= limit then
  return redis.error_reply('WRONGTYPE limit mismatch')
end
-- No slot for the caller, unless it holds one already (its earlier send's, counted
-- among `held`): only then is the owner looked for.
if place >= limit - held and (held == 0 or not redis.call('ZSCORE', lease_key, owner)) then
  return false
end
-- ZADD answers 0 for an owner already there: its earlier send's grant, answered again
-- with the token of its record (a record gone missing is written anew).
local record = false
if redis.call('ZADD', lease_key, now_ms + ttl, owner) == 0 then
  record = redis.call('HGET', holders_key, 'h:' .. owner)
end
local token
if record then
  token = tonumber(string.match(record, '^%d+'))
else
  token = next_token(last, now)
  local text = token_text(token)
  keep_token(fence_key, text, ttl)
  redis.call('HSET', holders_key, 'limit', limit, 'h:' .. owner, text .. ' ' .. holder)
end
if redis.call('PTTL', lease_key) < ttl then
  redis.call('PEXPIRE', lease_key, ttl)
  redis.call('PEXPIRE', holders_key, ttl)
end
if entries then
  leave_line(line_key, entries, claimant)
end
return token
"""
)

RENEW = (
    _NOW
    + _HOLDS
    + """
-- Extend each lease its owner still holds by its ttl.
-- KEYS: for each lease, its lease key and holders key. ARGV: for each, owner, ttl, limit.
-- Returns the 1-based positions of the leases found lost.
local lost = {}
local now_ms = math.floor(now_us() / 1000)
for i = 1, #ARGV / 3 do
  local lease_key, holders_key = KEYS[2 * i - 1], KEYS[2 * i]
  local owner, ttl, limit = ARGV[3 * i - 2], tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  if not holds(lease_key, owner, limit, now_ms) then
    table.insert(lost, i)
  elseif limit == 1 then
    redis.call('PEXPIRE', lease_key, ttl)
  else
    redis.call('ZADD', lease_key, 'XX', now_ms + ttl, owner)
    if redis.call('PTTL', lease_key) < ttl then
      redis.call('PEXPIRE', lease_key, ttl)
      redis.call('PEXPIRE', holders_key, ttl)
    end
  end
end
return lost
"""
)

#: Freeing a slot, as the release scripts share it.
_RELEASE = """
-- Free the owner's slot of a key and wake whoever may take it.
-- Returns 1 if the owner held the key, else 0 (and changes nothing).
local function release(lease_key, holders_key, line_key, signal_key, waiting_key,
                       owner, limit, signal_ttl)
  if limit == 1 then
    if not holds(lease_key, owner, 1, 0) then
      return 0
    end
    redis.call('DEL', lease_key)
  else
    if call_typed('ZREM', lease_key, owner) ~= 1 then  -- not held, or held as a mutex
      return 0
    end
    redis.call('HDEL', holders_key, 'h:' .. owner)
  end
  wake(line_key, signal_key, waiting_key, limit, signal_ttl)
  return 1
end
"""

#: Compare-and-swap of a mark, as the mark scripts share it.
_SWAP = """
-- Set (or, when `has_new` is false, delete) the mark `mark_key` if it holds `expected`
-- (absent when `has_expected` is false). Returns 1 if swapped, 0 if it held something else.
local function swap(mark_key, has_expected, expected, has_new, new, ttl)
  local current = redis.call('GET', mark_key)
  if has_expected then
    if current ~= expected then
      return 0
    end
  elseif current then
    return 0
  end
  if has_new then
    redis.call('SET', mark_key, new, 'PX', ttl)
  else
    redis.call('DEL', mark_key)
  end
  return 1
end

-- Set the mark `mark_key` to `new` as swap does; true also if it holds `new` already (a
-- client that sends the script again after losing its reply finds its own write).
local function set_mark(mark_key, has_expected, expected, new, ttl)
  return swap(mark_key, has_expected, expected, true, new, ttl) == 1
      or redis.call('GET', mark_key) == new
end
"""

RELEASE = (
    _NOW
    + _HOLDS
    + _LINE
    + _WAKE
    + _RELEASE
    + """
-- Free the owner's slot of a key and wake whoever may take it.
-- Returns 1 if the owner held the key, else 0 (and changes nothing).
local lease_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3]
local signal_key, waiting_key = KEYS[4], KEYS[5]
local owner, limit, signal_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3]

return release(lease_key, holders_key, line_key, signal_key, waiting_key,
               owner, limit, signal_ttl)
"""
)

FORCE_RELEASE = (
    _NOW
    + _LINE
    + _WAKE
    + """
-- Free every slot of a key, whoever holds it, and wake whoever may take one.
-- Returns how many live holders it had.
local lease_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3]
local signal_key, waiting_key = KEYS[4], KEYS[5]
local signal_ttl = ARGV[1]

local kind = redis.call('TYPE', lease_key).ok
local count, slots = 0, 1
if kind == 'string' then
  count = 1
elseif kind == 'zset' then
  count = redis.call('ZCOUNT', lease_key, '(' .. math.floor(now_us() / 1000), '+inf')
  slots = math.max(count, 1)
end
redis.call('DEL', lease_key, holders_key)
wake(line_key, signal_key, waiting_key, slots, signal_ttl)
return count
"""
)

FREE_FOR = (
    _NOW
    + _LINE
    + """
-- Whether a waiter may stop blocking: a slot of the key is free and nobody but the
-- claimant stands first in its line.
-- Returns 1 if so; else 0, after marking a waiter outside the line as blocking for
-- block_ms (so that a release wakes it).
local lease_key, holders_key, line_key, waiting_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local claimant, block_ms = ARGV[1], tonumber(ARGV[2])

local now = now_us()
local _, live = read_line(line_key, now / 1000000)
local free = true
local kind = redis.call('TYPE', lease_key).ok
if kind == 'string' then
  free = false
elseif kind == 'zset' then
  local running = redis.call('ZCOUNT', lease_key, '(' .. math.floor(now / 1000), '+inf')
  free = running < tonumber(redis.call('HGET', holders_key, 'limit') or 1)
end
if free and (live[1] == nil or live[1] == claimant) then
  return 1
end
if place_of(live, claimant) == #live then
  redis.call('SET', waiting_key, 1, 'PX', block_ms)
end
return 0
"""
)

DESCRIBE = (
    _NOW
    + """
-- What the store holds for a key, for holders() and the CLI.
-- Returns {'string', now_ms, pttl, value} for a mutex, {'zset', now_ms, owner, expiry,
-- detail, ...} for the live holders of a semaphore, {'none', now_ms} otherwise.
local lease_key, holders_key = KEYS[1], KEYS[2]

local now_ms = math.floor(now_us() / 1000)
local kind = redis.call('TYPE', lease_key).ok
if kind == 'string' then
  return {kind, now_ms, redis.call('PTTL', lease_key), redis.call('GET', lease_key)}
elseif kind ~= 'zset' then
  return {'none', now_ms}
end
local found = {kind, now_ms}
local live = redis.call('ZRANGEBYSCORE', lease_key, '(' .. now_ms, '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  local detail = redis.call('HGET', holders_key, 'h:' .. live[i]) or '0 {}'
  table.insert(found, live[i])
  table.insert(found, live[i + 1])
  table.insert(found, detail)
end
return found
"""
)

#: Not on a cluster: the keys it reads are found by SCAN, so no script can declare them.
HOLDERS_PAGE = (
    _NOW
    + """
-- A page of held keys for operators: SCAN on from `cursor` for the names matching
-- `pattern` (COUNT `count`, within 10..100), until `count` leases are found or `budget`
-- names were looked at (a bounded time inside Redis however sparse the matches); for
-- each lease, what
-- DESCRIBE returns and the key's marks of the kinds in ARGV[5...].
-- Returns {next cursor ('0': done), now_ms, {lease name, DESCRIBE's reply from its
-- kind on, {mark values, false where absent}}, ...}.
local pattern, cursor = ARGV[1], ARGV[2]
local count, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local step = math.max(10, math.min(count, 100))
local kinds = {}
for i = 5, #ARGV do
  table.insert(kinds, ARGV[i])
end

local now_ms = math.floor(now_us() / 1000)
local page, seen, looked = {cursor, now_ms}, {}, 0
repeat
  local reply = redis.call('SCAN', cursor, 'MATCH', pattern, 'COUNT', step)
  cursor = reply[1]
  looked = looked + step
  for _, name in ipairs(reply[2]) do
    -- A lease's name is the only one whose first '}' is its last character.
    if not seen[name] and string.find(name, '}', 1, true) == #name then
      seen[name] = true
      local kind = redis.call('TYPE', name).ok
      local held = {}
      if kind == 'string' then
        held = {redis.call('PTTL', name), redis.call('GET', name)}
      elseif kind == 'zset' then
        local live = redis.call('ZRANGEBYSCORE', name, '(' .. now_ms, '+inf', 'WITHSCORES')
        for i = 1, #live, 2 do
          table.insert(held, live[i])
          table.insert(held, live[i + 1])
          table.insert(held, redis.call('HGET', name .. ':holders', 'h:' .. live[i]) or '0 {}')
        end
      end
      if #held > 0 then
        local marks = {}
        for i, mark in ipairs(kinds) do
          marks[i] = redis.call('GET', name .. ':mark:' .. mark)
        end
        table.insert(page, {name, kind, held, marks})
      end
    end
  end
until cursor == '0' or #page - 2 >= count or looked >= budget
page[1] = cursor
return page
"""
)

WRITE_RECORD = (
    _NOW
    + _HOLDS
    + """
-- Write a record of a key if the owner holds the key now: the fenced write.
-- Returns 1 if written, 0 if the owner no longer holds the key.
local lease_key, record_key = KEYS[1], KEYS[2]
local owner, limit, value = ARGV[1], tonumber(ARGV[2]), ARGV[3]

local now_ms = limit == 1 and 0 or math.floor(now_us() / 1000)
if not holds(lease_key, owner, limit, now_ms) then
  return 0
end
redis.call('SET', record_key, value)
return 1
"""
)

SWAP_MARK = (
    _SWAP
    + """
-- Compare-and-swap a mark: set (or delete) it if it holds the expected value.
-- Returns 1 if swapped, 0 if the mark held something else.
local mark_key = KEYS[1]
local has_expected, expected = ARGV[1] == '1', ARGV[2]
local has_new, new, ttl = ARGV[3] == '1', ARGV[4], ARGV[5]

return swap(mark_key, has_expected, expected, has_new, new, ttl)
"""
)

#: Not on a cluster: the mark is another key's, so it may live in another hash slot.
SWAP_MARK_AND_RELEASE = (
    _NOW
    + _HOLDS
    + _LINE
    + _WAKE
    + _RELEASE
    + _SWAP
    + """
-- Set a mark if it holds the expected value, then free the owner's slot of a key: the
-- end of an attempt that records it ended, in one step.
-- Returns 1 if the owner held the key, 0 if not (the mark is set all the same), or -1
-- if the mark held something else (then nothing changed, and the key is still held).
-- A mark that already holds the new value counts as set: a client that sends the
-- script again after losing its reply finds its own write.
local lease_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3]
local signal_key, waiting_key, mark_key = KEYS[4], KEYS[5], KEYS[6]
local owner, limit, signal_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local has_expected, expected = ARGV[4] == '1', ARGV[5]
local new, ttl = ARGV[6], ARGV[7]

if not set_mark(mark_key, has_expected, expected, new, ttl) then
  return -1
end
return release(lease_key, holders_key, line_key, signal_key, waiting_key,
               owner, limit, signal_ttl)
"""
)

#: Not on a cluster: the written key (and the mark) may live in other hash slots, and
#: the written key in another database.
RELEASE_AND_WRITE = (
    _NOW
    + _HOLDS
    + _LINE
    + _WAKE
    + _RELEASE
    + _SWAP
    + """
-- Free the owner's slot of a key and, only if the owner held it, write a value of the
-- application's own (a task's result, as Celery's Redis result backend stores it) and
-- delete a mark that still holds the given value (the call's enqueue mark): the key is
-- free the moment the value can be read, and a holder that lost its lease writes
-- nothing. With a mark to set, first set it if it holds the expected value, as
-- swap_mark_and_release does (the end of an attempt, its record and its result at once).
-- Returns 1 if the owner held the key (and the value is written, or left as it was: a
-- stored value whose JSON status is keep_status stays), 0 if not (nothing written or
-- deleted; a mark is set all the same), or -1 if the mark held something else than
-- expected (nothing changed).
-- KEYS[7] and KEYS[8] are the marks to set and to clear; where there is none, the
-- lease key stands in (an ACL that limits key names checks every declared key) and
-- the flag in ARGV says it is unused.
local lease_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3]
local signal_key, waiting_key, write_key = KEYS[4], KEYS[5], KEYS[6]
local mark_key, clear_key = KEYS[7], KEYS[8]
local owner, limit, signal_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local lease_db, write_db = ARGV[4], ARGV[5]
local value, write_ttl, publish, keep_status = ARGV[6], tonumber(ARGV[7]), ARGV[8], ARGV[9]
local has_mark, has_expected, expected = ARGV[10] == '1', ARGV[11] == '1', ARGV[12]
local new, mark_ttl = ARGV[13], ARGV[14]
local has_clear, clear_value = ARGV[15] == '1', ARGV[16]

if has_mark and not set_mark(mark_key, has_expected, expected, new, mark_ttl) then
  return -1
end
local now_ms = limit == 1 and 0 or math.floor(now_us() / 1000)
if not holds(lease_key, owner, limit, now_ms) then
  return 0
end
if has_clear then
  swap(clear_key, true, clear_value, false, nil, 0)
end
-- The write before the release: should the server refuse it, the script stops with
-- the lease held.
if write_db ~= lease_db then
  redis.call('SELECT', write_db)
end
local current = redis.call('GET', write_key)
local ok, stored = pcall(cjson.decode, current or '')
if not (keep_status ~= '' and ok and type(stored) == 'table' and stored.status == keep_status) then
  if write_ttl > 0 then
    redis.call('SET', write_key, value, 'PX', write_ttl)
  else
    redis.call('SET', write_key, value)
  end
  if publish == '1' then
    redis.call('PUBLISH', write_key, value)
  end
end
if write_db ~= lease_db then
  redis.call('SELECT', lease_db)
end
return release(lease_key, holders_key, line_key, signal_key, waiting_key,
               owner, limit, signal_ttl)
"""
)

#: Every script, by the name the backend registers it under.
ALL = {
    "acquire": ACQUIRE,
    "renew": RENEW,
    "release": RELEASE,
    "force_release": FORCE_RELEASE,
    "free_for": FREE_FOR,
    "describe": DESCRIBE,
    "holders_page": HOLDERS_PAGE,
    "write_record": WRITE_RECORD,
    "swap_mark": SWAP_MARK,
    "swap_mark_and_release": SWAP_MARK_AND_RELEASE,
    "release_and_write": RELEASE_AND_WRITE,
}
