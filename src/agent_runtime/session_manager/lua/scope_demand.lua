-- scope_demand (read only): what a predictive warm pool is sized by, for one scope — the
-- arrival rates route_place.lua keeps, the live sessions and the routes waiting for a slot
-- (autoscale asks about every predictive scope each tick: one call per scope, pipelined).
-- Every key is of the scope. ~4 commands.
--
-- KEYS[1] scope:{sid}:arrivals HASH   KEYS[2] scope:{sid}:sessions SET
-- KEYS[3] scope:{sid}:waiters ZSET    KEYS[4] scope:{sid}:reserved ZSET
--
-- returns {now seconds, now microseconds, fast, slow, at (the arrivals hash's fields, ""
-- when absent), live sessions, live waiters + live reservations}
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rates = redis.call('HMGET', KEYS[1], 'fast', 'slow', 'at')
return {t[1], t[2], rates[1] or '', rates[2] or '', rates[3] or '',
  redis.call('SCARD', KEYS[2]),
  redis.call('ZCOUNT', KEYS[3], now, '+inf') + redis.call('ZCOUNT', KEYS[4], now, '+inf')}
