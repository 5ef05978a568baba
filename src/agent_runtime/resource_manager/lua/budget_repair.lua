-- budget_repair (uses _budget.lua): reconcile's repair of the budgets, from what the caller
-- read of the pools (which reconcile keeps equal to Kubernetes), of the pod index and of the
-- budget itself. The caller reads the budget's units before the pools, so a unit it drops was
-- there before it looked and its pod was gone when it looked.
--
-- KEYS[1..4] and ARGV[1..2]: see _budget.lua
-- ARGV[3 ..] entries, each: kind, id, n, n units to drop, m, m pairs (unit, score)
--   kind "scope" (id = scope_id): the drops leave the scope's units, the global ZSET and its
--        rule's (a pod neither registered nor indexed: its purge or registration died
--        half-way); the pairs must be counted (a registered pod "+inf", a live placeholder's
--        reservation its deadline) and are added where missing (the global ZSET, the scope's,
--        its rule's), a unit the scope holds keeping its score
--   kind "rule" (id = rule id): the drops leave that rule's ZSET only (units of no scope
--        linked to it); m = 0
--   kind "stray" (id ""): the drops leave the global ZSET and every rule's (units of no
--        scope); m = 0
--
-- returns {added, dropped}
--
-- invariant: never drops what the caller did not name; idempotent.
local now = now_seconds()
local added, dropped = 0, 0
local i = 3
while i <= #ARGV do
  local kind, id, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  for j = i + 3, i + 2 + n do
    local unit = ARGV[j]
    if kind == 'scope' then
      dropped = dropped + unit_remove(id, unit)
    elseif kind == 'rule' then
      dropped = dropped + redis.call('ZREM', rule_key(id), unit)
      rule_emptied(id)
    else
      dropped = dropped + redis.call('ZREM', KEYS[1], unit)
      for _, rule in ipairs(redis.call('SMEMBERS', KEYS[2])) do
        redis.call('ZREM', rule_key(rule), unit)
        rule_emptied(rule)
      end
    end
  end
  i = i + 3 + n
  local m = tonumber(ARGV[i])
  if kind == 'scope' then
    local linked = rule_key(linked_rule(id))
    for j = i + 1, i + 2 * m - 1, 2 do
      local unit, score = ARGV[j], ARGV[j + 1]
      local mine = redis.call('ZSCORE', units_key(id), unit)
      local missing = not mine or not redis.call('ZSCORE', KEYS[1], unit)
        or (linked and not redis.call('ZSCORE', linked, unit))
      if missing and (score == '+inf' or tonumber(score) >= now) then
        unit_add(id, unit, mine or score)  -- a unit the scope holds keeps its deadline
        added = added + 1
      end
    end
  end
  i = i + 1 + 2 * m
end
return {added, dropped}
