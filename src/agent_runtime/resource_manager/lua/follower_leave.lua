-- follower_leave: a follower leaves its seat in a deploy's room. One that leaves WITH the pod
-- counts as served in the deploy's record, so the room's seats + its served followers stay at
-- most pod_concurrency - 1 while the leader still holds its lock (its on_ready after the
-- registration): deploy_claim.lua seats a late caller only where that sum leaves room.
--
-- KEYS[1] resource:scope:{sid}:deploy_followers:{id}  ZSET the room
-- KEYS[2] resource:scope:{sid}:deploy_pod:{id}        HASH the deploy's record (field served)
-- ARGV[1] the follower's member (its request id)
-- ARGV[2] "1": it leaves with the pod; "0": without (its deadline passed, it failed or left)
--
-- returns 1 if the seat was there
--
-- invariant: a seat counts once: served only when its seat was removed here (a re-sent call
-- counts nothing); the record is never created here (a record gone: nothing left to count).
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[2] == '1' and removed == 1 and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'served', 1)
end
return removed
