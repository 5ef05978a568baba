-- scope_expire (uses _scope.lua): the session side of a scope leaves Redis if it is still empty; checked and
-- deleted in one step, so a route either saw the scope before (and then holds a session, a
-- reservation or a seat here: the scope is not empty) or finds it gone and rebuilds it from
-- the DB (resolve → scope_put). The caller asked the resource side first (its facade:
-- expire_scope) and read the idle mark (scope_idle:{bNN}, a key of no scope: the caller's);
-- it takes the scope out of the registry bucket and the indexes afterwards, by the entry this
-- returns. Every key is of the scope.
--
-- KEYS[1] scope:{sid}:entry    KEYS[2] scope:{sid}:config   KEYS[3] scope:{sid}:pod_seq
-- KEYS[4] scope:{sid}:sessions KEYS[5] scope:{sid}:pods     KEYS[6] scope:{sid}:waiters
-- KEYS[7] scope:{sid}:reserved KEYS[8] pods:{sid}:registered
--
-- returns {1, entry JSON or ""} expired, {0, ""} kept (in use again)
if scope_in_use(KEYS[4], KEYS[5], KEYS[8], KEYS[6], KEYS[7]) then return {0, ''} end
local entry = redis.call('GET', KEYS[1]) or ''
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
return {1, entry}
