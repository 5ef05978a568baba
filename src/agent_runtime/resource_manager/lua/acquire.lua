-- acquire (uses _budget.lua, _placeholders.lua): hand out a warm pod of the scope's current
-- version, or reserve a deploy slot within max_pods and the pod budgets.
--
-- KEYS[1] resource:scope:{sid}:config     HASH  (deploy_ver, max_pods, budget_rule)
-- KEYS[2] resource:scope:{sid}:idle       SET   warm pool
-- KEYS[3] resource:scope:{sid}:pods       ZSET  every pod of the scope
-- KEYS[4] resource:scope:{sid}:deploying  SET   placeholders "{token}@{deadline}"
-- KEYS[5] idem:{sid}:{request_id}         STRING cached acquire result (JSON, with its scope_id)
-- KEYS[6] budget:pods                     ZSET  every budget unit (see _budget.lua)
-- KEYS[7] budget:rules                    SET   rule ids that have a units ZSET
-- KEYS[8] budget:rule_limits              HASH  rule id -> pod budget
-- ARGV[1] pod key prefix "resource_manager:resource:pod:" (derives the warm pods'
--         resource:pod:{sid}:{pod}:info and :idle_since with pod_key: the scope's slot)
-- ARGV[2] placeholder token (unique per attempt; the same token on a re-sent call)
-- ARGV[3] placeholder lifetime in seconds (the deploy lease: its deployer renews it)
-- ARGV[4] idem TTL in seconds
-- ARGV[5] scope_id (written into the cached result)
-- ARGV[6] rule budget prefix "resource_manager:budget:rule:" (derives {prefix}{rule}:pods of
--         the scope's old and new rule: the other derived keys)
-- ARGV[7] rule id the scope resolves through now ("" = none): the scope's link is set to it
--         and its units move along when it changes
-- ARGV[8] that rule's pod budget (0 = unbounded), refreshed into KEYS[8]
-- ARGV[9] the installation's pod budget
-- ARGV[10] "1": a route's acquire, whose cold claim (deploy_claim.lua) reserves the slot in the
--          step that decides whether it follows or leads: no warm pod answers {"cold"}, and
--          nothing is reserved here ("" or absent: reserve as below)
--
-- returns {"cached", json}                 this request already got a pod (replay)
--         {"reuse", pod_id, pod_sse_url, deploy_ver}   a warm pod left the pool, now in use
--         {"no_config"}                    the scope has no pool config yet
--         {"max_reached"}                  ZCARD pods + SCARD deploying >= max_pods
--         {"budget_reached", "global"|"rule"}  a new pod would exceed that pod budget
--         {"need_deploy", member}          a placeholder was added (or already was: replay);
--                                          the caller marks the scope as leased
--         {"cold"}                         no warm pod (ARGV[10] "1"): claim a deploy
--
-- invariant: ZCARD pods + SCARD deploying <= max_pods, and a new placeholder only while each
-- budget's live units < its limit; expired placeholders (a crashed deployer) are dropped
-- before counting, so a crash never lowers the cap or a budget for good.
local cached = redis.call('GET', KEYS[5])
if cached then return {'cached', cached} end  -- the key is the scope's: its own result
if redis.call('EXISTS', KEYS[1]) == 0 then return {'no_config'} end

local sid, prefix, rule = ARGV[5], ARGV[6], ARGV[7]
local rule_limit, global_limit = tonumber(ARGV[8]), tonumber(ARGV[9])
local now = tonumber(redis.call('TIME')[1])
local linked = redis.call('HGET', KEYS[1], 'budget_rule') or ''
local mine = sweep_placeholders(KEYS[4], ARGV[2], now, sid, KEYS[6],
  rule_budget_key(prefix, linked))
local rule_key = rule_budget_key(prefix, rule)
if linked ~= rule then
  budget_move(sid, KEYS[3], KEYS[4], rule_budget_key(prefix, linked), rule_key, KEYS[7], rule)
  redis.call('HSET', KEYS[1], 'budget_rule', rule)
end
if rule ~= '' then
  if rule_limit > 0 then
    redis.call('HSET', KEYS[8], rule, rule_limit)
  else
    redis.call('HDEL', KEYS[8], rule)
  end
end
if mine then
  if ARGV[10] == '1' then return {'cold'} end  -- a re-sent claim finds its placeholder
  return {'need_deploy', mine}
end

-- a config without deploy_ver matches no pod (HGET of a missing field is false on both sides)
local version = redis.call('HGET', KEYS[1], 'deploy_ver')
local best, best_since = nil, -1
for _, pod in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local info = pod_key(ARGV[1], sid, pod, 'info')
  if version and redis.call('HGET', info, 'deploy_ver') == version then
    local since = tonumber(redis.call('GET', pod_key(ARGV[1], sid, pod, 'idle_since')) or '0')
    if since > best_since then best, best_since = pod, since end  -- most recently idle first
  end
end
if best then
  local info = pod_key(ARGV[1], sid, best, 'info')
  redis.call('SREM', KEYS[2], best)
  redis.call('DEL', pod_key(ARGV[1], sid, best, 'idle_since'))
  redis.call('HSET', info, 'phase', 'in_use')
  local url = redis.call('HGET', info, 'pod_sse_url') or ''
  redis.call('SET', KEYS[5], cjson.encode({pod_id = best, pod_sse_url = url, deploy_ver = version,
    scope_id = ARGV[5]}), 'EX', tonumber(ARGV[4]))
  return {'reuse', best, url, version}
end

if ARGV[10] == '1' then return {'cold'} end
local refused = room_refusal(KEYS[1], KEYS[3], KEYS[4], KEYS[6], global_limit, rule_key,
  rule_limit, now)
if refused then return refused end
return {'need_deploy', add_placeholder(KEYS[4], ARGV[2], now, tonumber(ARGV[3]), sid, KEYS[6],
  rule_key, KEYS[7], rule)}
