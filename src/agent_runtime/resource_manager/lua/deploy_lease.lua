-- deploy_lease (uses _placeholders.lua): a deploy keeps its claim alive. Its
-- placeholder's deadline moves to now + lease and, for a cold deploy, its deploy lock too, in
-- one step; once its pod is created the pod is recorded here, so that a leader taking
-- over after a lapse (deploy_claim.lua, deploy_lease_take.lua) finds it. The placeholder's
-- budget reservation is the caller's to renew after an "ok" (budget_renew.lua) and to give
-- back after a "lost" (budget_release.lua): another slot.
--
-- KEYS[1] resource:scope:{sid}:deploying   SET    placeholders "{token}@{deadline}"
-- KEYS[2] resource:scope:{sid}:config      HASH   (max_pods)
-- KEYS[3] resource:scope:{sid}:pods        ZSET
-- KEYS[4] lock:rm:deploy:{sid}:{id}            STRING the leader's token, PX the lease
-- KEYS[5] resource:scope:{sid}:deploy_pod:{id} HASH   the leader's pod (deploy_lease_take.lua)
-- KEYS[6] resource:scope:{sid}:cold_deploys ZSET  the scope's cold deploys (deploy_claim.lua)
-- ARGV[1] placeholder token (its member is "{token}@{deadline}")
-- ARGV[2] lock token ("" for a warm deploy: a placeholder and no lock)
-- ARGV[3] lease in seconds (the placeholder's deadline is whole seconds, rounded up; the
--         lock's PX runs to the end of that deadline's second: they lapse together)
-- ARGV[4] pod_id to record ("" = none; only with a lock token)   ARGV[5] its namespace
-- ARGV[6] seconds the record lives (the pod's own deadline: ready_timeout + margin)
-- ARGV[7] the pod's uid (its incarnation: a pod re-created under the name is not this one)
-- ARGV[8] the pod's cluster ("" = the process default: no `cluster` field is written)
-- ARGV[9] the deploy's id (its member of KEYS[6]; "" for a warm deploy)
--
-- returns {"ok", member}   renewed; member: the placeholder's new name
--         {"lost", "taken"}  another leader holds the lock, or held it (it took over after our
--                          lease lapsed: the record bears its token, or our pod is registered
--                          by now): a recorded pod is its. Nothing is taken back.
--         {"lost", "no_room"} nobody holds it, but our placeholder was swept and the scope has
--                          no room for it again: the pod is nobody's (the record stays for the
--                          next taker or reconcile).
--                          Either way our placeholder is given back; nothing is
--                          recorded; the caller stops claiming.
--
-- invariant: only the claim's owner renews it; a claim that lapsed with nobody taking it (no
-- record under another token, our pod not registered) is taken again (lock, placeholder) — the placeholder only within max_pods, as it was taken;
-- the record is written only under our own lock, and keeps its first created time.
-- Replay-safe: the placeholder is found by its token, so a re-sent call renews it again.
local clock = redis.call('TIME')
local now = tonumber(clock[1])
local ptoken, ltoken, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])

local function mine()
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    local at = string.find(member, '@[^@]*$')
    if at and string.sub(member, 1, at - 1) == ptoken then return member end
  end
  return nil
end

local member = mine()
if ltoken ~= '' then
  local holder = redis.call('GET', KEYS[4])
  local taken = holder and holder ~= ltoken
  if not holder then
    -- a lapse someone took over and ended meanwhile: its record bears the taker's token (or
    -- lapsed after its pod was registered); taking the lock back would hand the pod out twice
    local rec = redis.call('HGET', KEYS[5], 'token')
    taken = (rec and rec ~= ltoken)
      or (ARGV[4] ~= '' and redis.call('ZSCORE', KEYS[3], ARGV[4]) ~= false)
  end
  if taken then
    if member then redis.call('SREM', KEYS[1], member) end
    return {'lost', 'taken'}
  end
end
if member then
  redis.call('SREM', KEYS[1], member)
else
  -- swept after it expired: taken again only if the scope still has room for it
  sweep_placeholders(KEYS[1], ptoken, now)
  if at_max_pods(KEYS[2], KEYS[3], KEYS[1]) then return {'lost', 'no_room'} end
end
local renewed = add_placeholder(KEYS[1], ptoken, now, math.ceil(lease))
if ltoken ~= '' then
  -- until the placeholder lapses (it counts through its deadline's second): a lapsed lock
  -- means a lapsed slot, so a taker never runs beside a placeholder still counted
  local until_ms = (placeholder_deadline(renewed) + 1) * 1000
  local now_ms = now * 1000 + math.floor(tonumber(clock[2]) / 1000)
  redis.call('SET', KEYS[4], ltoken, 'PX', math.max(until_ms - now_ms, math.ceil(lease * 1000)))
  redis.call('ZADD', KEYS[6], 'NX', now, ARGV[9])  -- back in the index if a claim dropped it
  if ARGV[4] ~= '' then
    local rec = redis.call('HMGET', KEYS[5], 'token', 'pod_id')
    if rec[1] ~= ltoken or rec[2] ~= ARGV[4] then
      redis.call('DEL', KEYS[5])
      redis.call('HSET', KEYS[5], 'token', ltoken, 'pod_id', ARGV[4], 'namespace', ARGV[5],
        'created', clock[1], 'uid', ARGV[7])
      if ARGV[8] and ARGV[8] ~= '' then redis.call('HSET', KEYS[5], 'cluster', ARGV[8]) end
      redis.call('EXPIRE', KEYS[5], tonumber(ARGV[6]))
    end
  end
end
return {'ok', renewed}
