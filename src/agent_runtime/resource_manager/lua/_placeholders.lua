-- Shared by acquire.lua, placeholder.lua, adopt.lua, deploy_lease.lua and lease_prune.lua
-- (prepended when the scripts are loaded, after _budget.lua). A placeholder is "{token}@{deadline}" in
-- resource:scope:{sid}:deploying, its deadline a short lease that its deployer renews
-- (deploy_lease.lua): a deployer that died leaves one behind, and it stops counting against
-- max_pods (and the pod budgets) at its deadline, seconds later.

-- Drop expired placeholders (the caller's own too: an expired one no longer reserves a slot)
-- with their budget units; return the unexpired member already holding `token` (a re-sent
-- call), or nil.
local function sweep_placeholders(key, token, now, sid, global, rule_key)
  local mine = nil
  for _, member in ipairs(redis.call('SMEMBERS', key)) do
    local at = string.find(member, '@[^@]*$')
    local deadline = at and tonumber(string.sub(member, at + 1)) or 0
    if deadline < now then
      redis.call('SREM', key, member)
      budget_remove(global, rule_key, sid .. ':' .. member)
    elseif string.sub(member, 1, at - 1) == token then
      mine = member
    end
  end
  return mine
end

-- 'global' or 'rule' when a new unit would exceed that budget (limit 0: no rule budget)
local function budget_refusal(global, global_limit, rule_key, rule_limit, now)
  if budget_count(global, now) >= global_limit then return 'global' end
  if rule_key and rule_limit > 0 and budget_count(rule_key, now) >= rule_limit then
    return 'rule'
  end
  return nil
end

-- whether the scope holds max_pods already: its pods and its (unexpired: swept first)
-- placeholders; a config without max_pods holds none
local function at_max_pods(config, pods, deploying)
  local max_pods = tonumber(redis.call('HGET', config, 'max_pods') or '0')
  return redis.call('ZCARD', pods) + redis.call('SCARD', deploying) >= max_pods
end

-- why one more pod or placeholder may not come, as the script's reply: {'max_reached'} or
-- {'budget_reached', 'global'|'rule'}; nil when there is room (rule_limit 0: no rule budget)
local function room_refusal(config, pods, deploying, global, global_limit, rule_key, rule_limit,
    now)
  if at_max_pods(config, pods, deploying) then return {'max_reached'} end
  local refused = budget_refusal(global, global_limit, rule_key, rule_limit, now)
  if refused then return {'budget_reached', refused} end
  return nil
end

-- a linked rule's pod budget from budget:rule_limits (0: none, or no rule)
local function rule_limit_of(limits, rule)
  if rule == '' then return 0 end
  return tonumber(redis.call('HGET', limits, rule) or '0')
end

-- (the caller marks the scope in the leased scopes' index, where the prune job finds it:
-- another slot, so not here)
local function add_placeholder(key, token, now, lifetime, sid, global, rule_key, index, rule)
  local member = token .. '@' .. tostring(now + lifetime)
  redis.call('SADD', key, member)
  budget_add(global, rule_key, index, rule, sid .. ':' .. member, now + lifetime)
  return member
end
