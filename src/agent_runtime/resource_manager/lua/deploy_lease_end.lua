-- deploy_lease_end: a leader's deploy ended: its lock is given back (compare-and-delete). "ok":
-- its record stays a moment (it names the registered pod: the deploy's followers take it);
-- "failed": the record becomes a short notice, so that its followers fail fast instead of
-- taking a failed deploy over (same image, same failure); "done" (reconcile adopted or deleted
-- the pod): its record goes, and the deploy leaves the scope's index: nobody new joins it.
-- "none" (stopped, or lost): only the lock goes — the record and the index entry stay, so
-- that the next claim takes the deploy over with its pod (a gone pod is the taker's to find
-- out; the record lapses with the pod's own deadline).
--
-- KEYS[1] lock:rm:deploy:{sid}:{id}            STRING
-- KEYS[2] resource:scope:{sid}:deploy_pod:{id} HASH (see deploy_lease_take.lua)
-- KEYS[3] resource:scope:{sid}:cold_deploys    ZSET the scope's cold deploys
-- ARGV[1] lock token
-- ARGV[2] "ok" (the pod is registered), "failed" (the deploy failed: leave a notice), "done"
--         (reconcile settled the pod) or "none" (stopped or lost: a taker takes over)
-- ARGV[3] milliseconds the failure notice (and an "ok" record) lives
-- ARGV[4] the deploy's id
--
-- returns 1 if the lock was ours (given back), 0 otherwise
--
-- invariant: only the token's holder gives back the lock, writes a notice or drops the deploy
-- from the index; a record passed to another leader (takeover) is never touched. Replay-safe.
local mine = redis.call('GET', KEYS[1]) == ARGV[1]
if mine then redis.call('DEL', KEYS[1]) end
if ARGV[2] == 'none' then return mine and 1 or 0 end
if redis.call('HGET', KEYS[2], 'token') == ARGV[1] then
  if ARGV[2] == 'ok' then
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]))
  else
    redis.call('DEL', KEYS[2])
  end
end
if mine and ARGV[2] == 'failed' and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[2], 'token', ARGV[1], 'failed', '1')
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]))
end
if mine then redis.call('ZREM', KEYS[3], ARGV[4]) end
return mine and 1 or 0
