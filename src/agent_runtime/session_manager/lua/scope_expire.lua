-- scope_expire: the session side of a scope leaves Redis, if it is still empty and has been
-- so for the idle TTL; checked and deleted in one step, so a route either saw the scope
-- before (and then holds a session, a reservation or a seat here: the scope is not empty)
-- or finds it gone and rebuilds it from the DB (resolve → scope_put).
-- The caller asked the resource side first (its facade: expire_scope), so a resource-side
-- pool config never outlives the registry entry that config_sync propagation finds it by.
--
-- KEYS[1] scope_registry   KEYS[2] scope_idle
-- KEYS[3] scope:{sid}:config   KEYS[4] scope:{sid}:pod_seq   KEYS[5] scope:{sid}:sessions
-- KEYS[6] scope:{sid}:pods     KEYS[7] scope:{sid}:waiters   KEYS[8] scope:{sid}:reserved
-- ARGV[1] key prefix   ARGV[2] scope_id   ARGV[3] idle TTL (seconds)
--
-- returns 1 expired, 0 kept (in use again: its idle mark is dropped; or not idle long enough)
local p, sid, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local since = redis.call('ZSCORE', KEYS[2], sid)
if not since or tonumber(since) + ttl > now then return 0 end
if redis.call('SCARD', KEYS[5]) > 0 or redis.call('ZCARD', KEYS[6]) > 0
    or redis.call('ZCOUNT', KEYS[7], now, '+inf') > 0
    or redis.call('ZCOUNT', KEYS[8], now, '+inf') > 0 then
  redis.call('ZREM', KEYS[2], sid)
  return 0
end
local entry = redis.call('HGET', KEYS[1], sid)
if entry then
  local e = cjson.decode(entry)
  if e[3] and e[3] ~= '' then redis.call('SREM', p .. 'scope_index:template:' .. e[3], sid) end
  redis.call('SREM', p .. 'scope_index:group:' .. e[1], sid)
  redis.call('SREM', p .. 'scope_index:bot:' .. e[2], sid)
  redis.call('HDEL', KEYS[1], sid)
end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
redis.call('ZREM', KEYS[2], sid)
return 1
