"""The Lua scripts of the Redis store: every operation is one script, one round trip.

Each script says what it does, its KEYS, its ARGV and what it returns, then binds KEYS
and ARGV to named locals. A fact several scripts share (the store's clock, who holds a
key, the line, waking a waiter, the next token, freeing a slot, swapping a mark) is
written once below and put in front of the scripts that use it.

Names come from the layout (:mod:`.layout`, or the recipe's); every key a script
touches shares the hash slot of one lease key, so each script runs on one Redis Cluster
node. The exceptions, a mark read with a grant and :data:`END` (a mark of another key,
a key of the application's), run only off Cluster.

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

#: Freeing a slot, as the release scripts share it.
_RELEASE = """
-- Free the owner's slot of a key and wake whoever may take it: our waiters, and, when
-- `foreign_signal` is given (?recipe=set-nx, a key named `lock:<name>`),
-- python-redis-lock's waiters blocked on it, as its UNLOCK_SCRIPT wakes them: DEL,
-- LPUSH 1, PEXPIRE.
-- Returns 1 if the owner held the key, else 0 (and changes nothing).
local function release(lease_key, holders_key, line_key, signal_key, waiting_key,
                       owner, limit, signal_ttl, foreign_signal, foreign_ttl)
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
  if foreign_signal then
    redis.call('DEL', foreign_signal)
    redis.call('LPUSH', foreign_signal, 1)
    redis.call('PEXPIRE', foreign_signal, foreign_ttl)
  end
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
"""

ACQUIRE = (
    _NOW
    + _HOLDS
    + _LINE
    + _TOKEN
    + """
-- Grant a slot of a key if the line lets the caller in; read a mark with it.
-- KEYS: the lease, its fence, its holders, its line; optionally a mark to read (an
--       acks_late call's finished mark).
-- ARGV: owner, ttl (ms), limit, holder record (JSON), claimant ('' when not in line).
-- Returns the fencing token of the grant, or false when there is no slot for the
-- caller; with a mark to read, {that, the mark's value or false}.
-- Owners are unique per attempt, so a slot the owner already holds can only be this
-- very request, sent again by the client after its answer was lost: that grant is
-- answered again (its token, its ttl from now), never taken for somebody else's.
local lease_key, fence_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local mark_key = KEYS[5]
local owner, ttl, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local holder, claimant = ARGV[4], ARGV[5]

-- Read before anything is written, so that a mark that cannot be read grants nothing.
-- (Nobody writes between the read and the grant: the script is one step.)
local mark = mark_key and redis.call('GET', mark_key)
local now = now_us()

local function grant()
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
end

local answer = grant()
if mark_key and type(answer) ~= 'table' then  -- a table: an error reply, as it is
  return {answer, mark}
end
return answer
"""
)

RENEW = (
    _NOW
    + _HOLDS
    + """
-- Extend each lease its owner still holds by its ttl.
-- KEYS: for each lease, its lease key and its holders key.
-- ARGV: for each lease, its owner, ttl (ms) and limit.
-- Returns the 1-based positions of the leases found lost.
local count = #ARGV / 3

local lost = {}
local now_ms = math.floor(now_us() / 1000)
for i = 1, count do
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

RELEASE = (
    _NOW
    + _HOLDS
    + _LINE
    + _WAKE
    + _RELEASE
    + """
-- Free the owner's slot of a key and wake whoever may take it.
-- KEYS: the lease, its holders, its line, its wake-up list, its waiting flag;
--       optionally python-redis-lock's wake-up list of the key (?recipe=set-nx).
-- ARGV: owner, limit, the wake-up list's ttl (ms), python-redis-lock's (ms).
-- Returns 1 if the owner held the key, else 0 (and changes nothing).
local lease_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3]
local signal_key, waiting_key, foreign_signal = KEYS[4], KEYS[5], KEYS[6]
local owner, limit, signal_ttl, foreign_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

return release(lease_key, holders_key, line_key, signal_key, waiting_key,
               owner, limit, signal_ttl, foreign_signal, foreign_ttl)
"""
)

#: Not on a cluster: the mark and the written key may live in other hash slots, and the
#: written key in another database.
END = (
    _NOW
    + _HOLDS
    + _LINE
    + _WAKE
    + _RELEASE
    + _SWAP
    + """
-- End an attempt as its lease is freed, in one step: set its mark (its finished mark)
-- if it holds the expected value; then, only if the owner still holds the key, write a
-- value of the application's own (a task's result, as Celery's Redis result backend
-- stores it) and delete a mark that still holds the given value (the call's enqueue
-- mark); then free the key. The key is free the moment the value can be read, and a
-- holder that lost its lease writes nothing. A stored value whose JSON status is
-- keep_status stays (Celery never stores over a success). A mark that holds the new
-- value already counts as set: a client that sends the script again after losing its
-- answer finds its own write.
-- KEYS: the lease, its holders, its line, its wake-up list, its waiting flag, the mark
--       to set, the key to write, the mark to clear (the lease key stands in for each
--       of the last three not used: an ACL that limits key names checks every declared
--       name); optionally python-redis-lock's wake-up list (?recipe=set-nx).
-- ARGV: owner, limit, the wake-up list's ttl (ms), python-redis-lock's (ms); for the
--       mark: '1' if set, '1' if expected, expected, new, ttl (ms); for the write: '1'
--       if made, the lease's database, the write's, value, ttl (ms, 0: none), '1' to
--       publish it, keep_status; for the mark to clear: '1' if cleared, its value.
-- Returns 1 if the owner held the key (and the value is written, or kept); 0 if not
-- (nothing written or deleted; the mark is set all the same); 2 if not, and the key
-- to write holds the value already (or one to keep): a first send of this very script,
-- whose answer was lost, wrote it and freed the key; -1 if the mark held something
-- else than expected (nothing changed: the key is still held).
local lease_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3]
local signal_key, waiting_key, mark_key = KEYS[4], KEYS[5], KEYS[6]
local write_key, clear_key, foreign_signal = KEYS[7], KEYS[8], KEYS[9]
local owner, limit, signal_ttl, foreign_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local has_mark, has_expected, expected, new, mark_ttl = ARGV[5] == '1', ARGV[6] == '1',
                                                        ARGV[7], ARGV[8], ARGV[9]
local has_write, lease_db, write_db = ARGV[10] == '1', ARGV[11], ARGV[12]
local value, write_ttl, publish, keep_status = ARGV[13], tonumber(ARGV[14]), ARGV[15], ARGV[16]
local has_clear, clear_value = ARGV[17] == '1', ARGV[18]

-- `fn()`, run in the write's database (a SELECT in a script lasts until it ends).
local function in_write_db(fn)
  if write_db ~= lease_db then
    redis.call('SELECT', write_db)
  end
  local result = fn()
  if write_db ~= lease_db then
    redis.call('SELECT', lease_db)
  end
  return result
end

-- Whether `current` (a stored value) is one to keep: its JSON status is keep_status.
local function kept(current)
  local ok, stored = pcall(cjson.decode, current or '')
  return keep_status ~= '' and ok and type(stored) == 'table' and stored.status == keep_status
end

if has_mark then
  local set = swap(mark_key, has_expected, expected, true, new, mark_ttl) == 1
  if not set and redis.call('GET', mark_key) ~= new then
    return -1
  end
end
local now_ms = limit == 1 and 0 or math.floor(now_us() / 1000)
if not holds(lease_key, owner, limit, now_ms) then
  if has_write and in_write_db(function()
    local current = redis.call('GET', write_key)
    return current == value or kept(current)
  end) then
    return 2
  end
  return 0
end
if has_clear then
  swap(clear_key, true, clear_value, false, nil, 0)
end
-- The write before the release: should the server refuse it, the script stops with
-- the lease held.
if has_write then
  in_write_db(function()
    if kept(redis.call('GET', write_key)) then
      return
    end
    if write_ttl > 0 then
      redis.call('SET', write_key, value, 'PX', write_ttl)
    else
      redis.call('SET', write_key, value)
    end
    if publish == '1' then
      redis.call('PUBLISH', write_key, value)
    end
  end)
end
return release(lease_key, holders_key, line_key, signal_key, waiting_key,
               owner, limit, signal_ttl, foreign_signal, foreign_ttl)
"""
)

FORCE_RELEASE = (
    _NOW
    + _LINE
    + _WAKE
    + """
-- Free every slot of a key, whoever holds it, and wake whoever may take one.
-- KEYS: the lease, its holders, its line, its wake-up list, its waiting flag.
-- ARGV: the wake-up list's ttl (ms).
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
-- claimant stands first in its line; if not, a waiter outside the line is marked as
-- blocking, so that a release wakes it.
-- KEYS: the lease, its holders, its line, its waiting flag.
-- ARGV: claimant ('' when not in line), how long it blocks (ms).
-- Returns 1 if it may stop blocking, else 0.
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

#: What a key holds, for DESCRIBE and HOLDERS_PAGE.
_DESCRIBE = """
-- What the store holds at `lease_key`: 'string', {pttl, value} for a mutex; 'zset',
-- {owner, expiry, detail, ...} for the live holders of a semaphore; else 'none', {}.
local function describe(lease_key, holders_key, now_ms)
  local kind = redis.call('TYPE', lease_key).ok
  if kind == 'string' then
    return kind, {redis.call('PTTL', lease_key), redis.call('GET', lease_key)}
  elseif kind ~= 'zset' then
    return 'none', {}
  end
  local held = {}
  local live = redis.call('ZRANGEBYSCORE', lease_key, '(' .. now_ms, '+inf', 'WITHSCORES')
  for i = 1, #live, 2 do
    table.insert(held, live[i])
    table.insert(held, live[i + 1])
    table.insert(held, redis.call('HGET', holders_key, 'h:' .. live[i]) or '0 {}')
  end
  return kind, held
end
"""

DESCRIBE = (
    _NOW
    + _DESCRIBE
    + """
-- What the store holds for a key, for holders() and the CLI.
-- KEYS: the lease, its holders.
-- Returns {kind, now_ms, what describe() found for that kind}.
local lease_key, holders_key = KEYS[1], KEYS[2]

local now_ms = math.floor(now_us() / 1000)
local kind, held = describe(lease_key, holders_key, now_ms)
return {kind, now_ms, held}
"""
)

#: Not on a cluster: the keys it reads are found by SCAN, so no script can declare them.
HOLDERS_PAGE = (
    _NOW
    + _DESCRIBE
    + """
-- A page of held keys for operators: SCAN on from `cursor` for the names matching
-- `pattern` (COUNT `count`, within 10..100), until `count` leases are found or `budget`
-- names were looked at (a bounded time inside Redis however sparse the matches); each
-- lease described, with the key's marks.
-- ARGV: pattern, cursor, count, budget, then the kinds of marks to read.
-- Returns {next cursor ('0': done), now_ms, {lease name, kind, what describe() found,
-- {mark values, false where absent}}, ...}.
local pattern, cursor = ARGV[1], ARGV[2]
local count, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local kinds = {unpack(ARGV, 5)}

local step = math.max(10, math.min(count, 100))
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
      local kind, held = describe(name, name .. ':holders', now_ms)
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
-- KEYS: the lease, the record.
-- ARGV: owner, limit, value.
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
-- KEYS: the mark.
-- ARGV: '1' if a value is expected, expected, '1' if a value is set, new, ttl (ms).
-- Returns 1 if swapped, 0 if the mark held something else.
local mark_key = KEYS[1]
local has_expected, expected = ARGV[1] == '1', ARGV[2]
local has_new, new, ttl = ARGV[3] == '1', ARGV[4], ARGV[5]

return swap(mark_key, has_expected, expected, has_new, new, ttl)
"""
)

#: Every script, by the name the connection registers it under.
ALL = {
    "acquire": ACQUIRE,
    "renew": RENEW,
    "release": RELEASE,
    "end": END,
    "force_release": FORCE_RELEASE,
    "free_for": FREE_FOR,
    "describe": DESCRIBE,
    "holders_page": HOLDERS_PAGE,
    "write_record": WRITE_RECORD,
    "swap_mark": SWAP_MARK,
}
