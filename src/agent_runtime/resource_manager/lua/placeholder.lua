-- placeholder (uses _placeholders.lua): reserve a deploy slot for a warm pod (autoscale),
-- within max_pods. Never touches the warm pool: refilling the floor must not consume a warm
-- pod. The pod budgets are a step of their own (budget_reserve.lua, another slot): asked
-- with ARGV[3] "0", the script says whether a slot is free ({"reserve"}); the caller then
-- reserves the budget unit and asks again with "1", which adds the placeholder (or refuses:
-- the caller gives the unit back).
--
-- KEYS[1] resource:scope:{sid}:config     HASH (max_pods)
-- KEYS[2] resource:scope:{sid}:pods       ZSET
-- KEYS[3] resource:scope:{sid}:deploying  SET  placeholders "{token}@{deadline}"
-- ARGV[1] placeholder token (the same token on a re-sent call)
-- ARGV[2] placeholder lifetime in seconds (a deploy renews it: deploy_lease.lua)
-- ARGV[3] "1": the caller holds the token's budget reservation; "0": it does not yet
--
-- returns {"ok", member} (the caller marks the scope as leased), {"reserve"} (a slot is free:
--         reserve the budget unit, then call again with "1"), {"no_config"} or {"max_reached"}
--
-- invariant: ZCARD pods + SCARD deploying <= max_pods; a placeholder only with its budget unit.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'no_config'} end
local now = tonumber(redis.call('TIME')[1])
local mine = sweep_placeholders(KEYS[3], ARGV[1], now)
if mine then return {'ok', mine} end
if at_max_pods(KEYS[1], KEYS[2], KEYS[3]) then return {'max_reached'} end
if ARGV[3] ~= '1' then return {'reserve'} end
return {'ok', add_placeholder(KEYS[3], ARGV[1], now, tonumber(ARGV[2]))}
