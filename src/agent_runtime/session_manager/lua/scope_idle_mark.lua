-- scope_idle_mark: one HSCAN page of the scope registry; every scope found empty joins
-- scope_idle (first time seen empty), every scope in use leaves it. The expiry job then
-- expires, with scope_expire, the scopes empty for longer than the idle TTL.
--
-- KEYS[1] scope_registry   HASH
-- KEYS[2] scope_idle       ZSET sid -> Redis time it was first seen empty
-- ARGV[1] key prefix "session_manager:" (derives scope:{sid}:sessions|pods|waiters|reserved)
-- ARGV[2] HSCAN cursor   ARGV[3] page size (COUNT hint, 100: ~3.5 µs a scope here)
--
-- "empty": no live session, no placement candidate, no live waiter, no live reservation.
-- returns {next cursor, scopes seen, scopes marked empty}
local p = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local reply = redis.call('HSCAN', KEYS[1], ARGV[2], 'COUNT', tonumber(ARGV[3]))
local page, seen, empty = reply[2], 0, 0
for i = 1, #page, 2 do
  local sid = page[i]
  seen = seen + 1
  if redis.call('SCARD', scope_key(p, sid, 'sessions')) == 0
      and redis.call('ZCARD', scope_key(p, sid, 'pods')) == 0
      and redis.call('ZCOUNT', scope_key(p, sid, 'waiters'), now, '+inf') == 0
      and redis.call('ZCOUNT', scope_key(p, sid, 'reserved'), now, '+inf') == 0 then
    redis.call('ZADD', KEYS[2], 'NX', now, sid)
    empty = empty + 1
  else
    redis.call('ZREM', KEYS[2], sid)
  end
end
return {reply[1], seen, empty}
