-- cleanup_pod: drop every session-side registration of one (scope, pod).
--
-- KEYS[1] scope:{sid}:pods                ZSET placement candidates
-- KEYS[2] pod:{sid}:{pod}:info            HASH
-- KEYS[3] pod:{sid}:{pod}:sessions        SET
-- KEYS[4] pod:{sid}:{pod}:idle_notified   STRING
-- KEYS[5] pods:{sid}:registered          SET pod ids
-- ARGV[1] pod_id
--
-- returns -1 if sessions are still on the pod: it has left the candidates (no session can
--            be placed on it any more) but stays registered; the caller evicts them
--            (evict.lua, which frees their slots and wakes waiters) and calls again
--          1 if the pod was registered for the scope and is now gone, 0 if it was not
--
-- invariant: scope:{sid}:pods ⊆ pods:{sid}:registered (every key is of the scope); a session's pod stays registered while
-- the session lives. Idempotent.
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('SCARD', KEYS[3]) > 0 then return -1 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
return redis.call('SREM', KEYS[5], ARGV[1])
