-- retire_pod: a pod being drained leaves the placement candidates of every scope it is
-- registered in (as a sunset pod does: its sessions stay where they are); the sessions it
-- still carries are counted in the same step.
--
-- KEYS[1] pods:{pod}:scopes               SET the scopes the pod is registered in
--   per scope, derived from ARGV[1]:
--   scope:{sid}:pods               ZSET candidates
--   pod:{sid}:{pod}:sessions       SET
-- ARGV[1] key prefix "session_manager:"   ARGV[2] pod_id
--
-- returns the live sessions on the pod, over its scopes (0: nothing keeps it)
--
-- invariant: afterwards the pod is a candidate nowhere; a session is never touched.
-- Idempotent (the drain job repeats it each tick, so a registration that raced the drain's
-- start leaves again).
local p, pod = ARGV[1], ARGV[2]
local sessions = 0
for _, sid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  redis.call('ZREM', scope_key(p, sid, 'pods'), pod)
  sessions = sessions + redis.call('SCARD', pod_key(p, sid, pod, 'sessions'))
end
return sessions
