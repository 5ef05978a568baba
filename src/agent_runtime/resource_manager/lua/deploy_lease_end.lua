-- deploy_lease_end: a leader's deploy ended: its lock is given back (compare-and-delete) and its
-- pod record dropped; after a failure a short notice stays, so that its followers fail fast
-- instead of taking a failed deploy over (same image, same failure).
--
-- KEYS[1] lock:rm:deploy:{sid}             STRING
-- KEYS[2] resource:scope:{sid}:deploy_pod  HASH (see deploy_lease_take.lua)
-- ARGV[1] lock token
-- ARGV[2] "ok" (the pod is registered), "failed" (the deploy failed: leave a notice), or
--         "none" (stopped or lost: followers take over)
-- ARGV[3] milliseconds the failure notice lives
--
-- returns 1 if the lock was ours (given back), 0 otherwise
--
-- invariant: only the token's holder gives back the lock or writes a notice; a record passed
-- to another leader (takeover) is never touched. Replay-safe.
local mine = redis.call('GET', KEYS[1]) == ARGV[1]
if mine then redis.call('DEL', KEYS[1]) end
if redis.call('HGET', KEYS[2], 'token') == ARGV[1] then redis.call('DEL', KEYS[2]) end
if mine and ARGV[2] == 'failed' and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[2], 'token', ARGV[1], 'failed', '1')
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]))
end
return mine and 1 or 0
