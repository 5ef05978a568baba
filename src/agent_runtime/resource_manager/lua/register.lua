-- register: a deployed pod joins the scope's pool and gives back its placeholder. Its budget
-- unit took the place of the placeholder's reservation just before (budget_confirm.lua:
-- another slot).
--
-- KEYS[1] resource:pod:{sid}:{pod}:info           HASH
-- KEYS[2] resource:scope:{sid}:pods         ZSET  score = registration time (Redis, µs)
-- KEYS[3] resource:scope:{sid}:deploying    SET
-- KEYS[4] resource:scope:{sid}:idle         SET
-- KEYS[5] resource:pod:{sid}:{pod}:idle_since     STRING
-- ARGV[1] pod_id      ARGV[2] placeholder member ("" if none)
-- ARGV[3] scope_id    ARGV[4] pod_sse_url   ARGV[5] pod_ip   ARGV[6] namespace
-- ARGV[7] deploy_ver  ARGV[8] "1" = warm (straight into the idle pool), "0" = in use
-- ARGV[9] the pod's cluster ("" = the process default: no `cluster` field is written)
--
-- returns 1 if the placeholder was held (still unexpired when the pod was first registered),
-- 0 if it had expired or none was given (the pod is registered anyway: it exists in Kubernetes
-- and an untracked pod would leak). A re-sent call returns the same answer: the placeholder's
-- deadline is compared with the pod's first created_ts, not with whether it is still there.
--
-- invariant: a registered pod is in info + scope pods together; replay-safe
-- (created_ts, score, phase, idle and idle_since keep their first values: only the first
-- registration puts a warm pod into the pool, so a re-sent call never puts back a pod that an
-- acquire or reclaim has taken out of it meanwhile).
-- created_ts, the pods score and idle_since are "seconds.micros": a follower tells pods
-- registered after it started from ones registered just before
local clock = redis.call('TIME')
local now = string.format('%.6f', clock[1] + clock[2] / 1000000)
local first = redis.call('EXISTS', KEYS[1]) == 0
if first then
  local phase = ARGV[8] == '1' and 'idle' or 'in_use'
  redis.call('HSET', KEYS[1], 'scope_id', ARGV[3], 'pod_sse_url', ARGV[4], 'pod_ip', ARGV[5],
    'namespace', ARGV[6], 'phase', phase, 'created_ts', now, 'deploy_ver', ARGV[7])
  if ARGV[9] and ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'cluster', ARGV[9]) end
end
redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1])
local held = 0
if ARGV[2] ~= '' then
  local removed = redis.call('SREM', KEYS[3], ARGV[2])
  local at = string.find(ARGV[2], '@[^@]*$')
  local deadline = at and tonumber(string.sub(ARGV[2], at + 1)) or 0
  -- whole seconds, as the sweep: a placeholder still holds during its deadline second
  local created = math.floor(tonumber(redis.call('HGET', KEYS[1], 'created_ts') or now))
  if deadline >= created and (removed == 1 or not first) then held = 1 end
end
if first and ARGV[8] == '1' then
  redis.call('SADD', KEYS[4], ARGV[1])
  redis.call('SET', KEYS[5], now)
end
return held
