-- drop_placeholder: give back deploy placeholders (a deploy that failed or was not needed, a
-- caller whose reply was lost); the caller gives back their budget units after
-- (budget_release.lua: another slot).
--
-- KEYS[1] resource:scope:{sid}:deploying  SET  placeholders "{token}@{deadline}"
-- ARGV[1] "member": drop ARGV[2], the member itself; "token": drop every member taken with the
--         token ARGV[2] ("{token}@{deadline}": a caller that never saw its member)
--
-- returns how many placeholders were dropped
--
-- invariant: idempotent.
local members = {}
if ARGV[1] == 'member' then
  members[1] = ARGV[2]
else
  local prefix = ARGV[2] .. '@'
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    local at = string.find(member, '@[^@]*$')
    if at and string.sub(member, 1, at) == prefix then members[#members + 1] = member end
  end
end
local dropped = 0
for _, member in ipairs(members) do dropped = dropped + redis.call('SREM', KEYS[1], member) end
return dropped
