-- budget_reserve (uses _budget.lua): a unit for a pod on its way, within the installation's
-- pod budget and the scope's rule's; taken before the scope's script adds the deploy's
-- placeholder (deploy_claim, placeholder, adopt with their "reserved" argument), given back
-- (budget_release) when that script does not add it, moved to the pod (budget_confirm) when
-- the pod registers, renewed with the deploy's lease (budget_renew).
--
-- KEYS[1..4] and ARGV[1..2]: see _budget.lua
-- ARGV[3] scope_id   ARGV[4] unit ("{sid}:{placeholder token}", or a pod id for an adoption)
-- ARGV[5] seconds the reservation lives (the deploy lease; renewed by its leader)
-- ARGV[6] "1": link the scope to ARGV[7] (the rule it resolves through now, "" = none) whose
--         budget is ARGV[8] (0 = unbounded), as a route's acquire knows them; "0": keep the
--         scope's link and the rule's limit as they are (autoscale, reconcile)
-- ARGV[9] the installation's pod budget
--
-- returns {"ok"}                          reserved (or already: a re-sent call, its deadline
--                                         moved)
--         {"budget_reached", "global"|"rule"}  one more unit would exceed that budget
--
-- invariant: live units of each budget <= its limit after a reservation (a registered pod or
-- a renewed deploy counts even past it: the budgets refuse new pods only); replay-safe.
local sid, unit, lifetime = ARGV[3], ARGV[4], tonumber(ARGV[5])
local now = now_seconds()
if ARGV[6] == '1' then
  relink(sid, ARGV[7], now)
  set_rule_limit(ARGV[7], tonumber(ARGV[8]))
end
local deadline = math.floor(now) + lifetime  -- whole seconds, as a placeholder's
if redis.call('ZSCORE', units_key(sid), unit) then
  unit_add(sid, unit, deadline)  -- a re-sent call: the same reservation, its deadline moved
  return {'ok'}
end
if live_count(KEYS[1], now) >= tonumber(ARGV[9]) then return {'budget_reached', 'global'} end
local rule = linked_rule(sid)
local limit = rule ~= '' and tonumber(redis.call('HGET', KEYS[3], rule) or '0') or 0
if limit > 0 and live_count(rule_key(rule), now) >= limit then
  return {'budget_reached', 'rule'}
end
redis.call('ZREMRANGEBYSCORE', units_key(sid), '-inf', '(' .. now)
unit_add(sid, unit, deadline)
return {'ok'}
