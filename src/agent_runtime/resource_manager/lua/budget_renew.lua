-- budget_renew (uses _budget.lua): a deploy's reservation lives as long as its lease; the
-- leader moves its deadline with each renewal of the lease (after deploy_lease.lua said "ok").
-- A reservation that lapsed meanwhile is taken again, even past the budget: its deploy holds
-- a placeholder again (the scope's script took it back within max_pods), as a pod that exists
-- counts past the budget.
--
-- KEYS[1..4] and ARGV[1..2]: see _budget.lua
-- ARGV[3] scope_id   ARGV[4] unit   ARGV[5] seconds from now
--
-- returns 1 if the unit was live, 0 if it was taken again
local sid, unit = ARGV[3], ARGV[4]
local now = now_seconds()
local score = redis.call('ZSCORE', KEYS[1], unit)
unit_add(sid, unit, math.floor(now) + tonumber(ARGV[5]))  -- whole seconds
if score and tonumber(score) >= now then return 1 end
return 0
