-- seat_gate: take a seat in a bounded room of a scope, or be refused; a seated member calls it
-- again to renew its seat (a lease). One script for one idea, in the shared ground:
--   session manager:  the wait queue    scope:{sid}:waiters, limit 2 × scope_concurrency
--                     (registered as waiter_gate)
-- (the resource manager's follower rooms are seated by its deploy_claim.lua, one room per
-- cold deploy, in the step that decides follow or lead)
--
-- KEYS[1] the room               ZSET member -> deadline (Redis seconds, fractional)
-- KEYS[2] the module's leased_scopes  SET  scopes its prune job looks at
-- ARGV[1] member (the request_id of the waiting call)
-- ARGV[2] seconds the seat may be held unless renewed (fractional: 0.5 is half a second)
-- ARGV[3] limit (seats in the room; 0 refuses everyone)
-- ARGV[4] scope_id (joins KEYS[2] when seated)
--
-- returns 1 seated, 0 refused (the room is full; the seat was not kept)
--
-- invariant: ZCARD <= limit after every call. Add first, then leave again if over: never
-- "check then add", which lets two callers both see room for one. Deadlines are TIME to the
-- microsecond plus ARGV[2]: a seat of a crashed replica lapses when its lease does, not at the
-- next whole second; the prune jobs remove such seats where no caller comes. A seat whose
-- deadline is now is still held ('(' excludes it from the drop). Replay-safe: a re-sent call of
-- a seated member keeps its seat (its deadline renewed), one of a refused member is refused
-- again.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
-- the bound to the microsecond (a number concatenated as it is keeps 14 digits: 100 µs)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.6f', now))
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[3]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('SADD', KEYS[2], ARGV[4])
return 1
