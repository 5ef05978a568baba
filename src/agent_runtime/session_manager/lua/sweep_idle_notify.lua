-- sweep_idle_notify: empty pods are handed back once: each leaves the candidates in the same
-- step, so no route can pick a pod that is on its way to the warm pool. Called with a page of
-- registered pods (an SSCAN page of pods:registered), so a sweep of 10k pods is a handful of
-- calls instead of 10k round trips; a non-empty pod costs one SCARD here.
--
-- KEYS (derived from ARGV[1], per pod; one scope's keys per member):
--   pod:{sid}:{pod}:sessions        SET
--   pod:{sid}:{pod}:idle_notified   STRING (NX EX 60)
--   scope:{sid}:pods                ZSET candidates
--   pod:{sid}:{pod}:info            HASH (registered_at)
-- ARGV[1] key prefix "session_manager:"
-- ARGV[2] grace seconds: a pod registered less than this ago is left alone (its first
--         session is being placed right now)
-- ARGV[3..] members of pods:registered, "{sid}:{pod}"
--
-- returns the members that were empty, not yet notified, and are now out of the candidates
--
-- invariant: a pod with a session is never taken out here; at most one notice per 60 s.
local p, grace = ARGV[1], tonumber(ARGV[2])
local now = nil
local notified = {}
for i = 3, #ARGV do
  local member = ARGV[i]
  local colon = string.find(member, ':', 1, true)
  if colon then
    local sid, pod = string.sub(member, 1, colon - 1), string.sub(member, colon + 1)
    local base = p .. 'pod:' .. sid .. ':' .. pod
    if redis.call('SCARD', base .. ':sessions') == 0 and redis.call('EXISTS', base .. ':info') == 1 then
      if now == nil then
        local t = redis.call('TIME')
        now = tonumber(t[1]) + tonumber(t[2]) / 1000000
      end
      local since = tonumber(redis.call('HGET', base .. ':info', 'registered_at') or '0')
      if now - since >= grace and redis.call('SET', base .. ':idle_notified', '1', 'NX', 'EX', 60) then
        redis.call('ZREM', p .. 'scope:' .. sid .. ':pods', pod)
        notified[#notified + 1] = member
      end
    end
  end
end
return notified
