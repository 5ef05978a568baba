-- budget_release (uses _budget.lua): units of one scope given back: a reservation whose
-- deploy did not come (the scope's script refused it, the caller followed, the deploy failed
-- or lost its lease), a purged pod's unit.
--
-- KEYS[1..4] and ARGV[1..2]: see _budget.lua
-- ARGV[3] scope_id   ARGV[4 ..] units
--
-- returns how many units were there; idempotent
local sid, removed = ARGV[3], 0
for i = 4, #ARGV do removed = removed + unit_remove(sid, ARGV[i]) end
return removed
