-- purge: forget a pod: every resource_manager key of it, and its place in its scope's pool.
--
-- KEYS[1] resource:pod:{pod}:info          HASH (scope_id)
-- KEYS[2] resource:pod:{pod}:idle_since    STRING
-- KEYS[3] resource:pod:{pod}:health_fails  STRING
-- KEYS[4] resource:pods:all                SET
-- ARGV[1] pod_id
-- ARGV[2] scope key prefix, e.g. "resource_manager:resource:scope:" (derives
--         {prefix}{sid}:pods and {prefix}{sid}:idle from the pod's scope_id)
--
-- returns the pod's scope_id, or false if the pod was unknown (already purged)
--
-- invariant: afterwards no RM key names the pod; idempotent.
local scope = redis.call('HGET', KEYS[1], 'scope_id')
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
if not scope then return false end
redis.call('ZREM', ARGV[2] .. scope .. ':pods', ARGV[1])
redis.call('SREM', ARGV[2] .. scope .. ':idle', ARGV[1])
return scope
