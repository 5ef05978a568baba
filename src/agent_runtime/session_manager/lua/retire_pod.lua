-- retire_pod: a pod being drained leaves its scope's placement candidates (as a sunset pod
-- does: its sessions stay where they are); the sessions it still carries are counted in the
-- same step. The resource manager names the pod's scope (a pod belongs to one scope).
--
-- KEYS[1] scope:{sid}:pods               ZSET candidates
-- KEYS[2] pod:{sid}:{pod}:sessions       SET
-- ARGV[1] pod_id
--
-- returns the live sessions on the pod (0: nothing keeps it)
--
-- invariant: afterwards the pod is not a candidate of its scope; a session is never touched.
-- Idempotent (the drain job repeats it each tick, so a registration that raced the drain's
-- start leaves again).
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('SCARD', KEYS[2])
