-- budget_prune (uses _budget.lua): reconcile's repair, the other direction: drop units of one
-- budget that stand for nothing (a pod no longer registered, a placeholder given back or
-- expired, a unit of a scope now linked to another rule), each checked here, atomically.
--
-- KEYS[1] the budget: budget:pods, or budget:rule:{rule_id}:pods
-- KEYS[2] budget:rules        SET  rule ids that have a units ZSET
-- ARGV[1] rule id of KEYS[1] ("" for the global budget)
-- ARGV[2] scope key prefix (derives {prefix}{sid}:config, :pods, :deploying)
-- ARGV[3 ..] unit, scope, unit, scope ...: units read from KEYS[1] (at most a few hundred a
--         call), each with its pod's scope as the pod index names it ("" for a placeholder's
--         unit, which names its scope, or a pod the index does not know: not registered)
--
-- returns how many units were dropped; a rule whose ZSET is left empty leaves the index
local rule = ARGV[1]
local now = tonumber(redis.call('TIME')[1])
local function linked(sid)
  return rule == '' or redis.call('HGET', scope_key(ARGV[2], sid, 'config'), 'budget_rule') == rule
end
local dropped = 0
for i = 3, #ARGV, 2 do
  local unit = ARGV[i]
  local colon = string.find(unit, ':', 1, true)
  local valid
  if colon then
    local sid, member = string.sub(unit, 1, colon - 1), string.sub(unit, colon + 1)
    valid = placeholder_deadline(member) >= now
      and redis.call('SISMEMBER', scope_key(ARGV[2], sid, 'deploying'), member) == 1 and linked(sid)
  else
    local sid = ARGV[i + 1]
    valid = sid ~= '' and redis.call('ZSCORE', scope_key(ARGV[2], sid, 'pods'), unit)
      and linked(sid)
  end
  if not valid then dropped = dropped + redis.call('ZREM', KEYS[1], unit) end
end
if rule ~= '' and redis.call('ZCARD', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], rule) end
return dropped
