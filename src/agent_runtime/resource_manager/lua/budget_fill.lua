-- budget_fill (uses _budget.lua): reconcile's repair, one direction: every pod and unexpired
-- placeholder of the given scopes has its unit in the global budget and in its linked rule's
-- (after a Redis data loss, keys edited by hand, or units of a version without budgets).
--
-- KEYS[1] budget:pods    ZSET every budget unit
-- KEYS[2] budget:rules   SET  rule ids that have a units ZSET
-- ARGV[1] scope key prefix "resource_manager:resource:scope:" (derives {prefix}{sid}:config,
--         :pods and :deploying of each scope)
-- ARGV[2] rule budget prefix (derives {prefix}{budget_rule}:pods)
-- ARGV[3 ..] scope ids (at most a few hundred a call)
--
-- returns how many units were missing (and are now added)
--
-- invariant: never removes anything; idempotent.
local now = tonumber(redis.call('TIME')[1])
local added = 0
for i = 3, #ARGV do
  local sid = ARGV[i]
  local rule = redis.call('HGET', scope_key(ARGV[1], sid, 'config'), 'budget_rule') or ''
  local rule_key = rule_budget_key(ARGV[2], rule)
  local function fill(unit, score)
    added = added + redis.call('ZADD', KEYS[1], score, unit)
    if rule_key then
      redis.call('ZADD', rule_key, score, unit)
      redis.call('SADD', KEYS[2], rule)
    end
  end
  for _, pod in ipairs(redis.call('ZRANGE', scope_key(ARGV[1], sid, 'pods'), 0, -1)) do fill(pod, '+inf') end
  for _, member in ipairs(redis.call('SMEMBERS', scope_key(ARGV[1], sid, 'deploying'))) do
    local deadline = placeholder_deadline(member)
    if deadline >= now then fill(sid .. ':' .. member, deadline) end
  end
end
return added
