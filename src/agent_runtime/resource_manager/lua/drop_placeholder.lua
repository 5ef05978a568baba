-- drop_placeholder (uses _budget.lua): give back deploy placeholders and their budget units
-- (a deploy that failed or was not needed, a caller whose reply was lost).
--
-- KEYS[1] resource:scope:{sid}:config     HASH (budget_rule)
-- KEYS[2] resource:scope:{sid}:deploying  SET  placeholders "{token}@{deadline}"
-- KEYS[3] budget:pods                     ZSET every budget unit
-- ARGV[1] scope_id
-- ARGV[2] rule budget prefix (derives {prefix}{budget_rule}:pods of the scope's linked rule)
-- ARGV[3] "member": drop ARGV[4], the member itself; "token": drop every member taken with the
--         token ARGV[4] ("{token}@{deadline}": a caller that never saw its member)
--
-- returns how many placeholders were dropped
--
-- invariant: a placeholder and its units leave together; idempotent.
local rule_key = rule_budget_key(ARGV[2], redis.call('HGET', KEYS[1], 'budget_rule'))
local members = {}
if ARGV[3] == 'member' then
  members[1] = ARGV[4]
else
  local prefix = ARGV[4] .. '@'
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    local at = string.find(member, '@[^@]*$')
    if at and string.sub(member, 1, at) == prefix then members[#members + 1] = member end
  end
end
local dropped = 0
for _, member in ipairs(members) do
  dropped = dropped + redis.call('SREM', KEYS[2], member)
  budget_remove(KEYS[3], rule_key, ARGV[1] .. ':' .. member)
end
return dropped
