-- placeholder (uses _budget.lua, _placeholders.lua): reserve a deploy slot for a warm pod
-- (autoscale), within max_pods and the pod budgets. Never touches the warm pool: refilling the
-- floor must not consume a warm pod.
--
-- KEYS[1] resource:scope:{sid}:config     HASH (max_pods, budget_rule)
-- KEYS[2] resource:scope:{sid}:pods       ZSET
-- KEYS[3] resource:scope:{sid}:deploying  SET  placeholders "{token}@{deadline}"
-- KEYS[4] budget:pods                     ZSET every budget unit
-- KEYS[5] budget:rules                    SET  rule ids that have a units ZSET
-- KEYS[6] budget:rule_limits              HASH rule id -> pod budget
-- ARGV[1] placeholder token (the same token on a re-sent call)
-- ARGV[2] placeholder lifetime in seconds (a deploy renews it: deploy_lease.lua)
-- ARGV[3] scope_id
-- ARGV[4] rule budget prefix (derives {prefix}{budget_rule}:pods of the scope's linked rule)
-- ARGV[5] the installation's pod budget
--
-- returns {"ok", member} (the caller marks the scope as leased), {"no_config"},
--         {"max_reached"} or {"budget_reached", "global"|"rule"}
--
-- invariant: ZCARD pods + SCARD deploying <= max_pods; a new unit only under each budget.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'no_config'} end
local sid = ARGV[3]
local now = tonumber(redis.call('TIME')[1])
local rule = redis.call('HGET', KEYS[1], 'budget_rule') or ''
local rule_key = rule_budget_key(ARGV[4], rule)
local mine = sweep_placeholders(KEYS[3], ARGV[1], now, sid, KEYS[4], rule_key)
if mine then return {'ok', mine} end
local refused = room_refusal(KEYS[1], KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[5]), rule_key,
  rule_limit_of(KEYS[6], rule), now)
if refused then return refused end
return {'ok', add_placeholder(KEYS[3], ARGV[1], now, tonumber(ARGV[2]), sid, KEYS[4], rule_key,
  KEYS[5], rule)}
