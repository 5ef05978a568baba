-- Pod budgets (prepended to the budget_* scripts): every key they touch is of the budget's own
-- slot (hash tag "{budget}"), never a scope's. A scope's scripts decide within max_pods; the
-- budget is a step of its own, before (reserve) and after (confirm, release) them.
--
-- A budget is a ZSET of units: a registered pod (member = pod id, score +inf) or a reservation
-- for a pod on its way (member = "{sid}:{token}", the deploy's placeholder token; score = its
-- deadline, moved with the deploy's lease: budget_renew). Pod ids never hold ':'.
--   KEYS[1] budget:{budget}:pods                   ZSET  every unit of the installation
--   KEYS[2] budget:{budget}:rules                  SET   rule ids that have a units ZSET
--   KEYS[3] budget:{budget}:rule_limits            HASH  rule id -> its pod budget (>= 1)
--   KEYS[4] budget:{budget}:links                  HASH  scope id -> the rule it counts in
--                                                        ("" = none): every scope with a
--                                                        unit, and every scope linked to a rule
--   derived (same slot): {rule prefix}<rule>:pods  ZSET  the units of the rule's scopes
--                        {scope prefix}<sid>:units ZSET  the units of one scope
--   ARGV[1] rule prefix "…budget:{budget}:rule:"   ARGV[2] scope prefix "…budget:{budget}:scope:"
-- A unit is in the global ZSET, its scope's and its scope's linked rule's together, changed
-- in one script, so ZCARD (after the expired reservations are dropped) is exact.

local RULE_PREFIX, SCOPE_PREFIX = ARGV[1], ARGV[2]

local function rule_key(rule)
  if rule and rule ~= '' then return RULE_PREFIX .. rule .. ':pods' end
  return nil
end

local function units_key(sid) return SCOPE_PREFIX .. sid .. ':units' end

local function linked_rule(sid) return redis.call('HGET', KEYS[4], sid) or '' end

-- live units: expired reservations leave first (their deadline passed)
local function live_count(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. now)
  return redis.call('ZCARD', key)
end

local function unit_add(sid, unit, score)
  local rule = linked_rule(sid)
  redis.call('ZADD', KEYS[1], score, unit)
  redis.call('ZADD', units_key(sid), score, unit)
  redis.call('HSETNX', KEYS[4], sid, '')
  local key = rule_key(rule)
  if key then
    redis.call('ZADD', key, score, unit)
    redis.call('SADD', KEYS[2], rule)
  end
end

local function rule_emptied(rule)
  local key = rule_key(rule)
  if key and redis.call('EXISTS', key) == 0 then redis.call('SREM', KEYS[2], rule) end
end

-- returns 1 if the unit was there
local function unit_remove(sid, unit)
  local rule = linked_rule(sid)
  local removed = redis.call('ZREM', KEYS[1], unit)
  redis.call('ZREM', units_key(sid), unit)
  local key = rule_key(rule)
  if key then
    redis.call('ZREM', key, unit)
    rule_emptied(rule)
  end
  if redis.call('EXISTS', units_key(sid)) == 0 and rule == '' then
    redis.call('HDEL', KEYS[4], sid)
  end
  return removed
end

-- the scope counts in `rule` from now on ("" = none): its units move from the old rule's
-- ZSET to the new one's, O(the scope's units) <= max_pods + its reservations
local function relink(sid, rule, now)
  local old = linked_rule(sid)
  if old == rule then return end
  local old_key, new_key = rule_key(old), rule_key(rule)
  redis.call('ZREMRANGEBYSCORE', units_key(sid), '-inf', '(' .. now)
  local units = redis.call('ZRANGE', units_key(sid), 0, -1, 'WITHSCORES')
  for i = 1, #units, 2 do
    if old_key then redis.call('ZREM', old_key, units[i]) end
    if new_key then redis.call('ZADD', new_key, units[i + 1], units[i]) end
  end
  if old_key then rule_emptied(old) end
  redis.call('HSET', KEYS[4], sid, rule)
  if new_key and #units > 0 then redis.call('SADD', KEYS[2], rule) end
end

-- a rule's budget as the caller resolved it (0 = unbounded: the limit is dropped)
local function set_rule_limit(rule, limit)
  if rule == '' then return end
  if limit > 0 then
    redis.call('HSET', KEYS[3], rule, limit)
  else
    redis.call('HDEL', KEYS[3], rule)
  end
end

local function now_seconds()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
