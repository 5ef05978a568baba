-- purge (uses _budget.lua): forget a pod: every resource_manager key of it, its place in its
-- scope's pool, and its budget units (the budget unit given back).
--
-- KEYS[1] resource:pod:{pod}:info          HASH (scope_id)
-- KEYS[2] resource:pod:{pod}:idle_since    STRING
-- KEYS[3] resource:pod:{pod}:health_fails  STRING
-- KEYS[4] resource:pods:all                SET
-- KEYS[5] budget:pods                      ZSET every budget unit
-- KEYS[6] resource:pod:{pod}:drain         HASH its drain, if one was under way
-- KEYS[7] resource:draining                ZSET pod -> drain deadline
-- ARGV[1] pod_id
-- ARGV[2] scope key prefix, e.g. "resource_manager:resource:scope:" (derives
--         {prefix}{sid}:pods, {prefix}{sid}:idle and {prefix}{sid}:config from the pod's scope_id)
-- ARGV[3] rule budget prefix (derives {prefix}{budget_rule}:pods of the scope's linked rule)
--
-- returns the pod's scope_id, or false if the pod was unknown (already purged)
--
-- invariant: afterwards no RM key names the pod; idempotent.
local scope = redis.call('HGET', KEYS[1], 'scope_id')
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[6])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[7], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
if not scope then return false end
local rule = redis.call('HGET', scope_key(ARGV[2], scope, 'config'), 'budget_rule')
budget_remove(KEYS[5], rule_budget_key(ARGV[3], rule), ARGV[1])
redis.call('ZREM', scope_key(ARGV[2], scope, 'pods'), ARGV[1])
redis.call('SREM', scope_key(ARGV[2], scope, 'idle'), ARGV[1])
return scope
