-- scope_demand (read only): for many scopes, what a predictive warm pool is sized by — the
-- arrival rates route_place.lua keeps, the live sessions and the routes waiting for a slot —
-- in one call (autoscale asks about every predictive scope each tick). ~4 commands a scope.
--
-- KEYS (derived from ARGV[1], per scope): scope:{sid}:arrivals HASH, scope:{sid}:sessions SET,
--      scope:{sid}:waiters ZSET, scope:{sid}:reserved ZSET
-- ARGV[1] key prefix "session_manager:"   ARGV[2 ..] scope ids
--
-- returns {now seconds, now microseconds, then per scope in order: fast, slow, at (the
-- arrivals hash's fields, "" when absent), live sessions, live waiters + live reservations}
local p = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {t[1], t[2]}
for i = 2, #ARGV do
  local sid = ARGV[i]
  local rates = redis.call('HMGET', scope_key(p, sid, 'arrivals'), 'fast', 'slow', 'at')
  out[#out + 1] = rates[1] or ''
  out[#out + 1] = rates[2] or ''
  out[#out + 1] = rates[3] or ''
  out[#out + 1] = redis.call('SCARD', scope_key(p, sid, 'sessions'))
  out[#out + 1] = redis.call('ZCOUNT', scope_key(p, sid, 'waiters'), now, '+inf')
    + redis.call('ZCOUNT', scope_key(p, sid, 'reserved'), now, '+inf')
end
return out
