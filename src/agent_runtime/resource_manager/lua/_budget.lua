-- Pod budgets (prepended to the scripts that add or remove pods and placeholders).
--
-- A budget is a ZSET of units: a registered pod (member = pod id, score +inf) or a deploy
-- placeholder (member = "{sid}:{placeholder}", score = its deadline; pod ids never hold ':').
-- resource_manager:budget:pods holds every unit of the installation; a scope's units are also
-- in resource_manager:budget:rule:{rule_id}:pods of the rule its config links it to (field
-- budget_rule of resource:scope:{sid}:config; "" = none). The unit goes in and out in the same
-- script as the pod or placeholder itself, so ZCARD = pods + unexpired placeholders, exactly;
-- an expired placeholder's unit is dropped by score before any count (ZREMRANGEBYSCORE).
-- Derived keys: the rule ZSET from a rule prefix (ARGV) and the scope's budget_rule.

local function rule_budget_key(prefix, rule)
  if rule and rule ~= '' then return prefix .. rule .. ':pods' end
  return nil
end

local function placeholder_deadline(member)
  local at = string.find(member, '@[^@]*$')
  return at and tonumber(string.sub(member, at + 1)) or 0
end

-- into the global budget and the rule's (rule_key nil: none); the index lists rule ZSETs
local function budget_add(global, rule_key, index, rule, unit, score)
  redis.call('ZADD', global, score, unit)
  if rule_key then
    redis.call('ZADD', rule_key, score, unit)
    redis.call('SADD', index, rule)
  end
end

local function budget_remove(global, rule_key, unit)
  redis.call('ZREM', global, unit)
  if rule_key then redis.call('ZREM', rule_key, unit) end
end

-- live units: expired placeholders' units leave first (their deadline passed)
local function budget_count(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. now)
  return redis.call('ZCARD', key)
end

-- a scope's units follow its link: from the old rule's ZSET to the new one's (either may be
-- nil), O(pods + placeholders of the scope) <= max_pods
local function budget_move(sid, pods_key, deploying_key, old_key, new_key, index, rule)
  local function move(unit, score)
    if old_key then redis.call('ZREM', old_key, unit) end
    if new_key then redis.call('ZADD', new_key, score, unit) end
  end
  for _, pod in ipairs(redis.call('ZRANGE', pods_key, 0, -1)) do move(pod, '+inf') end
  for _, member in ipairs(redis.call('SMEMBERS', deploying_key)) do
    move(sid .. ':' .. member, placeholder_deadline(member))
  end
  if new_key then redis.call('SADD', index, rule) end
end
