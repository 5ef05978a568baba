-- sweep_idle_notify: a scope's empty pods are handed back once: each leaves the candidates in
-- the same step, so no route can pick a pod that is on its way to the warm pool. One call
-- looks at one scope's registered pods (at most its max_pods): every key is of the scope.
-- A non-empty pod costs one SCARD.
--
-- KEYS[1] pods:{sid}:registered   SET pod ids
-- KEYS[2] scope:{sid}:pods        ZSET candidates
--   per pod, derived from ARGV[1]:
--   pod:{sid}:{pod}:sessions        SET
--   pod:{sid}:{pod}:idle_notified   STRING (NX EX 60)
--   pod:{sid}:{pod}:info            HASH (registered_at)
-- ARGV[1] key prefix "session_manager:"
-- ARGV[2] grace seconds: a pod registered less than this ago is left alone (its first
--         session is being placed right now)
-- ARGV[3] scope_id
--
-- returns the pod ids that were empty, not yet notified, and are now out of the candidates
--
-- invariant: a pod with a session is never taken out here; at most one notice per 60 s.
local p, grace, sid = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local out = {}
local now = nil
for _, pod in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local info = pod_key(p, sid, pod, 'info')
  if redis.call('SCARD', pod_key(p, sid, pod, 'sessions')) == 0 and redis.call('EXISTS', info) == 1 then
    if now == nil then
      local t = redis.call('TIME')
      now = tonumber(t[1]) + tonumber(t[2]) / 1000000
    end
    local since = tonumber(redis.call('HGET', info, 'registered_at') or '0')
    if now - since >= grace and redis.call('SET', pod_key(p, sid, pod, 'idle_notified'), '1', 'NX', 'EX', 60) then
      redis.call('ZREM', KEYS[2], pod)
      out[#out + 1] = pod
    end
  end
end
return out
