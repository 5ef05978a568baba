-- Shared by scope_empty.lua and scope_expire.lua (prepended when they are loaded, after
-- _keys.lua): what "a scope in use" means to the scope expiry.

-- Whether the scope holds anything: a live session, a placement candidate, a registered pod,
-- a live queue seat or a live reservation (seats and reservations past their deadline do not
-- count: a replica that died left them). Reads the Redis clock.
local function scope_in_use(sessions, pods, registered, waiters, reserved)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  return redis.call('SCARD', sessions) > 0 or redis.call('ZCARD', pods) > 0
    or redis.call('SCARD', registered) > 0
    or redis.call('ZCOUNT', waiters, now, '+inf') > 0
    or redis.call('ZCOUNT', reserved, now, '+inf') > 0
end
