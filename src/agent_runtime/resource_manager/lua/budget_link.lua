-- budget_link (uses _budget.lua): the scope resolves through another rule now (a route's
-- acquire saw its link change): its units move to that rule's ZSET; the rule's limit as the
-- route resolved it. Also run with ARGV[4] "" and ARGV[6] "forget" when the scope's pool keys
-- expire: its link leaves once it holds no unit.
--
-- KEYS[1..4] and ARGV[1..2]: see _budget.lua
-- ARGV[3] scope_id   ARGV[4] rule id ("" = none)   ARGV[5] its pod budget (0 = unbounded)
-- ARGV[6] "forget": drop the scope's link and its units' ZSET if it holds no live unit
--
-- returns how many units moved (forget: 1 if the scope was forgotten)
local sid, rule = ARGV[3], ARGV[4]
local now = now_seconds()
if ARGV[6] == 'forget' then
  if live_count(units_key(sid), now) > 0 then return 0 end
  relink(sid, '', now)
  redis.call('HDEL', KEYS[4], sid)
  redis.call('DEL', units_key(sid))
  return 1
end
local moved = 0
if linked_rule(sid) ~= rule then moved = redis.call('ZCARD', units_key(sid)) end
relink(sid, rule, now)
set_rule_limit(rule, tonumber(ARGV[5]))
return moved
