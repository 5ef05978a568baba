-- seat_prune: the prune job's slice. Queue seats and reservations stop counting at their
-- deadline (a 3 s lease their route renews) in every script that counts them, but stay as
-- members until a route of the scope comes; a replica that died leaves them behind in scopes
-- nobody routes to. This drops them, and a scope left with neither leaves the index.
--
-- KEYS[1] leased_scopes   SET scopes that took a seat or a reservation
-- ARGV[1] key prefix "session_manager:" (derives scope:{sid}:waiters and scope:{sid}:reserved)
-- ARGV[2 ..] scope ids (25 a call: ~5 commands each, ~0.25–0.4 ms in all)
--
-- returns {seats dropped, reservations dropped}
--
-- invariant: only members past their deadline go; a scope leaves the index only when it holds
-- neither, in the same step (waiter_gate and route_place add it again with a new member).
-- Replay-safe.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local seats, reserved = 0, 0
for i = 2, #ARGV do
  local waiters = scope_key(ARGV[1], ARGV[i], 'waiters')
  local reserved_key = scope_key(ARGV[1], ARGV[i], 'reserved')
  seats = seats + redis.call('ZREMRANGEBYSCORE', waiters, '-inf', '(' .. now)
  reserved = reserved + redis.call('ZREMRANGEBYSCORE', reserved_key, '-inf', '(' .. now)
  if redis.call('ZCARD', waiters) == 0 and redis.call('ZCARD', reserved_key) == 0 then
    redis.call('SREM', KEYS[1], ARGV[i])
  end
end
return {seats, reserved}
