-- release: an in-use pod joins the warm pool; its pod_ttl clock starts (idle_consider).
--
-- KEYS[1] resource:scope:{sid}:pods       ZSET
-- KEYS[2] resource:scope:{sid}:idle       SET
-- KEYS[3] resource:pod:{pod}:idle_since   STRING
-- KEYS[4] resource:pod:{pod}:info         HASH
-- ARGV[1] pod_id
--
-- returns 1 if the pod became idle now, 0 if it already was, is not in the scope's pool
-- (purged, or another scope's pod) or is draining (drain_begin.lua: it never goes back)
--
-- invariant: idle_since exists <=> the pod is in the idle set; idempotent.
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == false then return 0 end
if redis.call('HGET', KEYS[4], 'phase') == 'draining' then return 0 end
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('SET', KEYS[3], redis.call('TIME')[1])
redis.call('HSET', KEYS[4], 'phase', 'idle')
return 1
