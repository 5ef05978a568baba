-- seat_prune: the prune job's look at one scope. Queue seats and reservations stop counting at
-- their deadline (a 3 s lease their route renews) in every script that counts them, but stay
-- as members until a route of the scope comes; a replica that died leaves them behind in
-- scopes nobody routes to. This drops them. Every key is of the scope.
--
-- KEYS[1] scope:{sid}:waiters    ZSET request_id -> deadline
-- KEYS[2] scope:{sid}:reserved   ZSET request_id -> deadline
--
-- returns {seats dropped, reservations dropped, next}: next is the earliest deadline left
--         ("" when neither holds anything), what the caller settles the scope's
--         leased_scopes entry with (scope_buckets.DueIndex)
--
-- invariant: only members past their deadline go. Replay-safe.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local seats = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
local reserved = redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. now)
local next_ = nil
for _, key in ipairs(KEYS) do
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if first[2] and (not next_ or tonumber(first[2]) < next_) then next_ = tonumber(first[2]) end
end
return {seats, reserved, next_ and string.format('%.6f', next_) or ''}
