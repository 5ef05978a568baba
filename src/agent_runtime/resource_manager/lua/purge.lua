-- purge: forget a pod: every resource_manager key of it in its scope and its place in its
-- scope's pool. The pod index (resource:pods:{bNN}), the draining pods
-- (resource:draining:{bNN}) and the pod's budget unit (budget_release.lua) are the caller's,
-- after this script (other slots).
--
-- KEYS[1] resource:pod:{sid}:{pod}:info          HASH (scope_id)
-- KEYS[2] resource:pod:{sid}:{pod}:idle_since    STRING
-- KEYS[3] resource:pod:{sid}:{pod}:health_fails  STRING
-- KEYS[4] resource:pod:{sid}:{pod}:drain         HASH its drain, if one was under way
-- KEYS[5] resource:scope:{sid}:pods              ZSET
-- KEYS[6] resource:scope:{sid}:idle              SET
-- ARGV[1] pod_id
--
-- returns the pod's scope_id (its info's), or false if the pod was unknown (already purged)
--
-- invariant: afterwards no RM key of the scope names the pod; idempotent.
local scope = redis.call('HGET', KEYS[1], 'scope_id')
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('SREM', KEYS[6], ARGV[1])
return scope or false
