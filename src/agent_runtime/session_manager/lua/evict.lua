-- evict: the only way a session leaves. It leaves its four places together and a waiter of
-- its scope is signalled.
--
-- KEYS[1] session:{session_id}   HASH (scope_id, pod_id, expiry, session_ttl)
-- KEYS[2] session_expiry         ZSET
-- ARGV[1] key prefix "session_manager:" (derives scope:{sid}:sessions,
--         pod:{sid}:{pod}:sessions and the channel scope:{sid}:free from the session hash)
-- ARGV[2] session_id
--
-- returns {} for an unknown session (nothing to do; a stray expiry entry is dropped), else
--         {scope_id, pod_id, sessions_left_on_pod}
--
-- invariant: a live session is in session:{id}, session_expiry, scope:{sid}:sessions and
-- pod:{sid}:{pod}:sessions at once, or in none of them. Idempotent.
local p = ARGV[1]
local scope = redis.call('HGET', KEYS[1], 'scope_id')
local pod = redis.call('HGET', KEYS[1], 'pod_id')
redis.call('ZREM', KEYS[2], ARGV[2])
if not scope or not pod then
  redis.call('DEL', KEYS[1])
  return {}
end
redis.call('DEL', KEYS[1])
redis.call('SREM', p .. 'scope:' .. scope .. ':sessions', ARGV[2])
local pod_sessions = p .. 'pod:' .. scope .. ':' .. pod .. ':sessions'
redis.call('SREM', pod_sessions, ARGV[2])
redis.call('PUBLISH', p .. 'scope:' .. scope .. ':free', ARGV[2])
return {scope, pod, redis.call('SCARD', pod_sessions)}
