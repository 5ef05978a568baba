-- adopt (uses _budget.lua, _placeholders.lua): reconcile takes a pod of ours that Kubernetes
-- has and Redis does not know (its identity was verified before) into its scope's warm pool.
--
-- KEYS[1] resource:pod:{sid}:{pod}:info           HASH
-- KEYS[2] resource:scope:{sid}:pods         ZSET  score = registration time (Redis, µs)
-- KEYS[3] resource:scope:{sid}:deploying    SET   placeholders "{token}@{deadline}"
-- KEYS[4] resource:scope:{sid}:idle         SET
-- KEYS[5] resource:pod:{sid}:{pod}:idle_since     STRING
-- KEYS[6] resource:scope:{sid}:config       HASH  (deploy_ver, max_pods, budget_rule)
-- KEYS[7] budget:pods                       ZSET  every budget unit
-- KEYS[8] budget:rules                      SET   rule ids that have a units ZSET
-- KEYS[9] budget:rule_limits                HASH  rule id -> pod budget
-- ARGV[1] pod_id   ARGV[2] scope_id   ARGV[3] pod_sse_url   ARGV[4] pod_ip
-- ARGV[5] namespace   ARGV[6] deploy_ver (the pod's, signed)
-- ARGV[7] rule budget prefix (derives {prefix}{budget_rule}:pods)
-- ARGV[8] the installation's pod budget
-- ARGV[9] the pod's cluster ("" = the process default: no `cluster` field is written)
--
-- returns {"adopted", "configured"}   the scope has a pool config: the pod is of its current
--                                     version, within max_pods and the pod budgets
--         {"adopted", "unconfigured"} the scope has no pool config (Redis lost its data): the
--                                     pod joins the warm pool as it is; its unit goes to the
--                                     global budget (the rule's follows at the scope's next
--                                     acquire); the first route writes the config, and from
--                                     then on the normal reclaim rules apply (an old version
--                                     goes at once)
--         {"known"}                   the pod is registered already (a re-sent call, or its
--                                     deploy registered it meanwhile): nothing done
--         {"old_version"} | {"max_reached"} | {"budget_reached", "global"|"rule"}: not adopted
--
-- invariant: the config check and the registration are one step, so a route writing the
-- config in between can never see max_pods exceeded by an adoption; a registered pod is in
-- info + scope pods + idle (+ idle_since) + its budgets together; replay-safe.
if redis.call('EXISTS', KEYS[1]) == 1 then return {'known'} end
local sid = ARGV[2]
local clock = redis.call('TIME')
local seconds = tonumber(clock[1])
local now = string.format('%.6f', clock[1] + clock[2] / 1000000)
local rule, rule_key, mode = '', nil, 'unconfigured'
if redis.call('EXISTS', KEYS[6]) == 1 then
  mode = 'configured'
  if redis.call('HGET', KEYS[6], 'deploy_ver') ~= ARGV[6] then return {'old_version'} end
  rule = redis.call('HGET', KEYS[6], 'budget_rule') or ''
  rule_key = rule_budget_key(ARGV[7], rule)
  sweep_placeholders(KEYS[3], '', seconds, sid, KEYS[7], rule_key)  -- expired ones go
  local refused = room_refusal(KEYS[6], KEYS[2], KEYS[3], KEYS[7], tonumber(ARGV[8]), rule_key,
    rule_limit_of(KEYS[9], rule), seconds)
  if refused then return refused end
end
redis.call('HSET', KEYS[1], 'scope_id', sid, 'pod_sse_url', ARGV[3], 'pod_ip', ARGV[4],
  'namespace', ARGV[5], 'phase', 'idle', 'created_ts', now, 'deploy_ver', ARGV[6])
if ARGV[9] and ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'cluster', ARGV[9]) end
redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1])
budget_add(KEYS[7], rule_key, KEYS[8], rule, ARGV[1], '+inf')
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('SET', KEYS[5], now)
return {'adopted', mode}
