-- budget_confirm (uses _budget.lua): a pod registers (or is adopted): its unit (score +inf)
-- takes the place of the deploy's reservation. Run after the pod index names the pod and
-- before register.lua (a crash between leaves a unit of an indexed pod: counted, and
-- reconcile's repair drops it once the index no longer names the pod), so a registered pod is
-- never uncounted.
--
-- KEYS[1..4] and ARGV[1..2]: see _budget.lua
-- ARGV[3] scope_id   ARGV[4] pod_id   ARGV[5] the reservation's unit ("" = none: an adoption
--         of a scope without pool config, a registration without placeholder)
--
-- returns 1 if the reservation was there, else 0 (expired, or none: the pod counts anyway)
--
-- invariant: idempotent; a pod's unit goes in whatever the budget's count.
local sid, pod, reserved = ARGV[3], ARGV[4], ARGV[5]
local held = 0
if reserved ~= '' and reserved ~= pod then held = unit_remove(sid, reserved) end
if reserved == pod and redis.call('ZSCORE', KEYS[1], pod) then held = 1 end
unit_add(sid, pod, '+inf')
return held
