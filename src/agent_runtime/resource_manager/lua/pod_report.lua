-- pod_report: the gate of a gateway's report of a pod (route's rawdata.failed_pod_id): at most
-- one probe per pod per window across every replica, and its verdict shared for the window.
--
-- KEYS[1] resource:pod:{sid}:{pod_id}:reported   STRING "probing" while the window's one probe runs,
--         then its verdict (healthy | suspect | dead | unknown); lives ARGV[2] ms from the claim
-- ARGV[1] "claim" | "answer"
-- ARGV[2] claim: the window (ms)   answer: the verdict
--
-- returns claim:  {1, "probing"}   the caller probes (the window starts now)
--                 {0, seen}        a probe of this window is running ("probing") or has
--                                  answered (its verdict): no new probe
--         answer: {1, verdict}     the window's value is the verdict now (kept for the rest
--                                  of the window), or {0, ""} when the window ended meanwhile
--                                  (nothing is written: the next report probes again)
--
-- invariant: one "probing" per pod per window; the key never outlives its window.
-- Replay-safe: a re-sent claim finds its own "probing" (no second probe), an answer again
-- writes the same verdict.
if ARGV[1] == 'claim' then
  local seen = redis.call('GET', KEYS[1])
  if seen then return {0, seen} end
  redis.call('SET', KEYS[1], 'probing', 'PX', tonumber(ARGV[2]))
  return {1, 'probing'}
end
local left = redis.call('PTTL', KEYS[1])
if left <= 0 then return {0, ''} end
redis.call('SET', KEYS[1], ARGV[2], 'PX', left)
return {1, ARGV[2]}
