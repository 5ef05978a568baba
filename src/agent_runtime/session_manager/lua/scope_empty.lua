-- scope_empty (read only; uses _scope.lua): whether a scope holds nothing — no live session, no placement
-- candidate, no registered pod, no live queue seat, no live reservation. The scope expiry's
-- mark walk asks it of each registry entry (one call per scope, pipelined a page at a time).
-- Every key is of the scope.
--
-- KEYS[1] scope:{sid}:sessions   KEYS[2] scope:{sid}:pods   KEYS[3] pods:{sid}:registered
-- KEYS[4] scope:{sid}:waiters    KEYS[5] scope:{sid}:reserved
--
-- returns 1 empty, 0 in use
if scope_in_use(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]) then return 0 end
return 1
