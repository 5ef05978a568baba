-- sweep_idle_notify: an empty pod is handed back once: it leaves the candidates in the same
-- step, so no route can pick a pod that is on its way to the warm pool.
--
-- KEYS[1] pod:{sid}:{pod}:sessions        SET
-- KEYS[2] pod:{sid}:{pod}:idle_notified   STRING (NX EX 60)
-- KEYS[3] scope:{sid}:pods                ZSET candidates
-- KEYS[4] pod:{sid}:{pod}:info            HASH (registered_at)
-- ARGV[1] pod_id
-- ARGV[2] grace seconds: a pod registered less than this ago is left alone (its first
--         session is being placed right now)
--
-- returns 1 if the pod was empty, not yet notified, and is now out of the candidates; else 0
--
-- invariant: a pod with a session is never taken out here; at most one notice per 60 s.
if redis.call('SCARD', KEYS[1]) > 0 then return 0 end
if redis.call('EXISTS', KEYS[4]) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local since = tonumber(redis.call('HGET', KEYS[4], 'registered_at') or '0')
if now - since < tonumber(ARGV[2]) then return 0 end
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', 60) then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
