-- scope_empty (read only): whether a scope holds nothing — no live session, no placement
-- candidate, no registered pod, no live queue seat, no live reservation. The scope expiry's
-- mark walk asks it of each registry entry (one call per scope, pipelined a page at a time).
-- Every key is of the scope.
--
-- KEYS[1] scope:{sid}:sessions   KEYS[2] scope:{sid}:pods   KEYS[3] pods:{sid}:registered
-- KEYS[4] scope:{sid}:waiters    KEYS[5] scope:{sid}:reserved
--
-- returns 1 empty, 0 in use
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if redis.call('SCARD', KEYS[1]) > 0 or redis.call('ZCARD', KEYS[2]) > 0
    or redis.call('SCARD', KEYS[3]) > 0
    or redis.call('ZCOUNT', KEYS[4], now, '+inf') > 0
    or redis.call('ZCOUNT', KEYS[5], now, '+inf') > 0 then
  return 0
end
return 1
