-- seat_gate: take a seat in a bounded room of a scope, or be refused; a seated member calls it
-- again to renew its seat (a lease). One script for one idea, in the shared ground:
--   session manager:  the wait queue    scope:{sid}:waiters, limit 2 × scope_concurrency
--                     (registered as waiter_gate)
-- (the resource manager's follower rooms are seated by its deploy_claim.lua, one room per
-- cold deploy, in the step that decides follow or lead)
--
-- KEYS[1] the room               ZSET member -> deadline (Redis seconds, fractional)
-- ARGV[1] member (the request_id of the waiting call)
-- ARGV[2] seconds the seat may be held unless renewed (fractional: 0.5 is half a second)
-- ARGV[3] limit (seats in the room; 0 refuses everyone)
--
-- returns 0 refused (the room is full; the seat was not kept), 1 seated again (a renewal),
--         or the new seat's deadline (a string, Redis seconds): the caller tells its module's
--         prune index (the session manager's leased_scopes, a key of no scope) about it
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
local deadline = now + tonumber(ARGV[2])
local new = redis.call('ZADD', KEYS[1], deadline, ARGV[1])
if redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[3]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
if new == 1 then return string.format('%.6f', deadline) end
return 1
