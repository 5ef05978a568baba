-- sweep_idle_notify: empty pods are handed back once: each leaves the candidates in the same
-- step, so no route can pick a pod that is on its way to the warm pool. One call walks one
-- SSCAN page of pods:registered (the cursor goes back and forth with the caller), so a sweep
-- of 10k pods is ~50 calls, each holding Redis ~0.6 ms; a non-empty pod costs one SCARD.
--
-- KEYS[1] pods:registered                 SET "{sid}:{pod}"
--   per member, derived from ARGV[1]:
--   pod:{sid}:{pod}:sessions        SET
--   pod:{sid}:{pod}:idle_notified   STRING (NX EX 60)
--   scope:{sid}:pods                ZSET candidates
--   pod:{sid}:{pod}:info            HASH (registered_at)
-- ARGV[1] key prefix "session_manager:"
-- ARGV[2] grace seconds: a pod registered less than this ago is left alone (its first
--         session is being placed right now)
-- ARGV[3] SSCAN cursor ("0" to start)   ARGV[4] SSCAN COUNT (the page size)
--
-- returns {next_cursor ("0": the walk is done), member, member ...}: the members that were
--         empty, not yet notified, and are now out of the candidates
--
-- invariant: a pod with a session is never taken out here; at most one notice per 60 s.
local p, grace = ARGV[1], tonumber(ARGV[2])
local page = redis.call('SSCAN', KEYS[1], ARGV[3], 'COUNT', tonumber(ARGV[4]))
local out = {page[1]}
local now = nil
for _, member in ipairs(page[2]) do
  local colon = string.find(member, ':', 1, true)
  if colon then
    local sid, pod = string.sub(member, 1, colon - 1), string.sub(member, colon + 1)
    local info = pod_key(p, sid, pod, 'info')
    if redis.call('SCARD', pod_key(p, sid, pod, 'sessions')) == 0 and redis.call('EXISTS', info) == 1 then
      if now == nil then
        local t = redis.call('TIME')
        now = tonumber(t[1]) + tonumber(t[2]) / 1000000
      end
      local since = tonumber(redis.call('HGET', info, 'registered_at') or '0')
      if now - since >= grace and redis.call('SET', pod_key(p, sid, pod, 'idle_notified'), '1', 'NX', 'EX', 60) then
        redis.call('ZREM', scope_key(p, sid, 'pods'), pod)
        out[#out + 1] = member
      end
    end
  end
end
return out
