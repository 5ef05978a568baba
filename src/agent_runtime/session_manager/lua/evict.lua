-- evict (uses _session.lua): the only way a session leaves. It leaves its four places
-- together and a waiter of its scope is signalled. Every key is of the scope.
--
-- KEYS[1] session:{sid}:{session_id}   HASH (scope_id, pod_id, expiry, session_ttl)
-- KEYS[2] scope:{sid}:session_expiry   ZSET
-- ARGV[1] key prefix "session_manager:" (derives scope:{sid}:sessions,
--         pod:{sid}:{pod}:sessions, the channel scope:{sid}:free and, with ARGV[3],
--         previous_pod:{sid}:{session_id})
-- ARGV[2] session_id
-- ARGV[3] "1" when the pod died: remember it for session_ttl so the next route is `rebound`
-- ARGV[4] scope_id
--
-- returns {} for a session unknown in the scope (nothing to do; a stray expiry entry is
--         dropped), else {scope_id, pod_id, sessions_left_on_pod}
--
-- invariant: a live session is in session:{sid}:{id}, scope:{sid}:session_expiry,
-- scope:{sid}:sessions and pod:{sid}:{pod}:sessions at once, or in none of them. Idempotent.
local ttl = 0
if ARGV[3] == '1' then ttl = tonumber(redis.call('HGET', KEYS[1], 'session_ttl') or '0') end
local left = evict_session(ARGV[1], ARGV[4], ARGV[2], ttl)
if not left then return {} end
return {ARGV[4], left[1], left[2]}
