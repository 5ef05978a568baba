-- waiter_gate: take a seat in the scope's wait queue, or be refused.
--
-- KEYS[1] scope:{sid}:waiters   ZSET member -> deadline (Redis seconds)
-- KEYS[2] leased_scopes         SET  scopes the prune job looks at (seat_prune.lua)
-- ARGV[1] member (request_id)   ARGV[2] seconds the seat may be held
-- ARGV[3] limit (2 × scope_concurrency)   ARGV[4] scope_id
--
-- returns 1 seated, 0 refused (the queue is full; the seat was not kept)
--
-- invariant: ZCARD <= limit after every call. Add first, then leave again if over: never
-- "check then add", which lets two callers both see room for one. Seats of a crashed
-- replica expire by their deadline score; the prune job removes them where no route comes.
-- Replay-safe: a re-sent call of a seated member keeps its seat (its deadline is renewed),
-- one of a refused member is refused again.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[3]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('SADD', KEYS[2], ARGV[4])
return 1
