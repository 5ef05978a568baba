-- adopt (uses _placeholders.lua): reconcile takes a pod of ours that Kubernetes has and Redis
-- does not know (its identity was verified before) into its scope's warm pool. The pod
-- budgets are a step of their own (another slot): for a scope with a pool config the script
-- first says whether the pod fits ({"reserve"}); the caller reserves its unit
-- (budget_reserve.lua, unit = the pod id) and calls again with ARGV[8] "1"; after an
-- adoption the caller confirms the unit (budget_confirm.lua), after a refusal gives it back.
--
-- KEYS[1] resource:pod:{sid}:{pod}:info           HASH
-- KEYS[2] resource:scope:{sid}:pods         ZSET  score = registration time (Redis, µs)
-- KEYS[3] resource:scope:{sid}:deploying    SET   placeholders "{token}@{deadline}"
-- KEYS[4] resource:scope:{sid}:idle         SET
-- KEYS[5] resource:pod:{sid}:{pod}:idle_since     STRING
-- KEYS[6] resource:scope:{sid}:config       HASH  (deploy_ver, max_pods)
-- ARGV[1] pod_id   ARGV[2] scope_id   ARGV[3] pod_sse_url   ARGV[4] pod_ip
-- ARGV[5] namespace   ARGV[6] deploy_ver (the pod's, signed)
-- ARGV[7] the pod's cluster ("" = the process default: no `cluster` field is written)
-- ARGV[8] "1": the caller holds the pod's budget unit; "0": not yet
--
-- returns {"adopted", "configured"}   the scope has a pool config: the pod is of its current
--                                     version, within max_pods (and its budget unit held)
--         {"adopted", "unconfigured"} the scope has no pool config (Redis lost its data): the
--                                     pod joins the warm pool as it is (its unit is counted
--                                     past the budgets); the first route writes the config,
--                                     and from then on the normal reclaim rules apply (an old
--                                     version goes at once)
--         {"reserve"}                 (ARGV[8] "0") the pod fits: reserve its unit, call again
--         {"known"}                   the pod is registered already (a re-sent call, or its
--                                     deploy registered it meanwhile): nothing done
--         {"old_version"} | {"max_reached"}: not adopted
--
-- invariant: the config check and the registration are one step, so a route writing the
-- config in between can never see max_pods exceeded by an adoption; a registered pod is in
-- info + scope pods + idle (+ idle_since) together; replay-safe.
if redis.call('EXISTS', KEYS[1]) == 1 then return {'known'} end
local sid = ARGV[2]
local clock = redis.call('TIME')
local seconds = tonumber(clock[1])
local now = string.format('%.6f', clock[1] + clock[2] / 1000000)
local mode = 'unconfigured'
if redis.call('EXISTS', KEYS[6]) == 1 then
  mode = 'configured'
  if redis.call('HGET', KEYS[6], 'deploy_ver') ~= ARGV[6] then return {'old_version'} end
  sweep_placeholders(KEYS[3], '', seconds)  -- expired ones go
  if at_max_pods(KEYS[6], KEYS[2], KEYS[3]) then return {'max_reached'} end
  if ARGV[8] ~= '1' then return {'reserve'} end
end
redis.call('HSET', KEYS[1], 'scope_id', sid, 'pod_sse_url', ARGV[3], 'pod_ip', ARGV[4],
  'namespace', ARGV[5], 'phase', 'idle', 'created_ts', now, 'deploy_ver', ARGV[6])
if ARGV[7] and ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'cluster', ARGV[7]) end
redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('SET', KEYS[5], now)
return {'adopted', mode}
