-- deploy_lease_take: become the leader of one cold deploy of a scope (reconcile's, for a pod it
-- found whose record names it; a route's claim is deploy_claim.lua), on a short lease; the pod
-- that a leader whose lease lapsed had created (recorded by deploy_lease.lua) passes to the new
-- leader in the same step.
--
-- KEYS[1] lock:rm:deploy:{sid}:{id}       STRING the leader's token "{uuid}@{acquire start}",
--                                          PX the lease (renewed by deploy_lease.lua)
-- KEYS[2] resource:scope:{sid}:deploy_pod:{id} HASH the leader's pod: token, pod_id, namespace,
--                                          created (Redis seconds), uid, cluster (absent:
--                                          the process default); or a failure
--                                          notice: token, failed (deploy_lease_end.lua)
-- KEYS[3] resource:scope:{sid}:pods       ZSET   the scope's pods (registered: a member)
-- ARGV[1] token   ARGV[2] lease in milliseconds
--
-- returns {"leader"}                                the lease is ours, nothing to inherit
--         {"leader", pod_id, namespace, created, uid, cluster ("": the default)}
--                                                   ours, with a pod created under a lease that
--                                                   lapsed (its creator died or lost Redis):
--                                                   ours now, to adopt or delete
--         {"follower", holder}                      a live leader holds it (holder: its token)
-- A call by the holder itself extends the lease to ARGV[2] from now: the same answer again.
--
-- invariant: one holder at a time (the lock is set only when absent); a recorded pod passes to
-- exactly one new holder, with the lease, so two followers never both take over; a failure
-- notice or a record of a pod that is registered by now is dropped, never inherited.
-- Replay-safe: a re-sent call of the holder gets the same answer (and extends its lease).
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return {'follower', holder} end
-- absent: taken; ours: extended (reconcile takes again before it acts on the pod)
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
local rec = redis.call('HMGET', KEYS[2], 'token', 'pod_id', 'namespace', 'created', 'failed',
  'uid', 'cluster')
if not rec[1] then return {'leader'} end
if rec[1] ~= ARGV[1] then
  if rec[5] or not rec[2] or redis.call('ZSCORE', KEYS[3], rec[2]) then
    redis.call('DEL', KEYS[2])
    return {'leader'}
  end
  redis.call('HSET', KEYS[2], 'token', ARGV[1])  -- keeps its expiry: the pod's own deadline
end
if not rec[2] then return {'leader'} end
return {'leader', rec[2], rec[3] or '', rec[4] or '0', rec[6] or '', rec[7] or ''}
