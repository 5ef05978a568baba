-- lease_prune (uses _placeholders.lua): the prune job's look at one scope of the
-- leased scopes' index. Follower seats and placeholders stop counting at their deadline in
-- every script that counts them, but stay as members until one of those runs for the scope; a
-- replica that died leaves them behind in scopes nobody routes to. This drops them, and a cold
-- deploy whose leader is gone from the scope's deploy index once nothing is left to take over:
-- it died before its create, or its pod is registered (adopted by reconcile, or registered by
-- a leader that died before it ended its lease: its record goes too). It says when to look
-- at the scope again (the index is another slot: the caller settles it).
--
-- KEYS[1] resource:scope:{sid}:deploying     SET  placeholders "{token}@{deadline}"
-- KEYS[2] resource:scope:{sid}:cold_deploys  ZSET the scope's cold deploys
-- KEYS[3] resource:scope:{sid}:pods          ZSET the scope's pods (registered: a member)
-- ARGV[1] deploy lock prefix "…lock:rm:deploy:{sid}:" (derives each deploy's lock {prefix}{id})
-- ARGV[2] scope prefix "…resource:scope:{sid}:" (derives per deploy :deploy_followers:{id}
--         and :deploy_pod:{id})
-- ARGV[3] seconds after which to look again at a scope whose cold deploys have no deadline
--         of their own here (a live leader: its lease is renewed)
--
-- returns {follower seats dropped, placeholders dropped, when to look next}: the Redis time
-- (seconds, as a string) of the soonest deadline still held (a seat or a placeholder), or now
-- + ARGV[5] for a live cold deploy; "" when the scope holds none of them (it may leave the
-- index)
--
-- invariant: only members past their deadline go (a placeholder's budget reservation lapses
-- at the same deadline, in the budget's slot: nothing to give back here); a
-- deploy leaves the index only without a live leader and with nothing to take over (a pod
-- still starting waits for a leader to take it over, or for its record's own expiry).
-- Replay-safe.
local now = tonumber(redis.call('TIME')[1])
local seats, placeholders = 0, 0
local soonest = nil
local function keep(deadline)
  if deadline and (not soonest or deadline < soonest) then soonest = deadline end
end
local before = redis.call('SCARD', KEYS[1])
if before > 0 then
  sweep_placeholders(KEYS[1], '', now)
  placeholders = before - redis.call('SCARD', KEYS[1])
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    keep(placeholder_deadline(member) + 1)  -- it counts through its deadline's second
  end
end
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local room = ARGV[2] .. 'deploy_followers:' .. id
  seats = seats + redis.call('ZREMRANGEBYSCORE', room, '-inf', '(' .. now)
  local record = ARGV[2] .. 'deploy_pod:' .. id
  local stays = true
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then
    local rec = redis.call('HMGET', record, 'token', 'pod_id', 'failed')
    if not rec[1] or rec[3] or not rec[2] or redis.call('ZSCORE', KEYS[3], rec[2]) then
      if rec[2] and not rec[3] then redis.call('DEL', record) end
      redis.call('ZREM', KEYS[2], id)
      stays = false  -- its room's seats wait for nothing now (the room expires by itself)
    end
  end
  if stays then
    -- a live leader, or a pod to take over: looked at again in a while, or at a seat's end
    keep(now + tonumber(ARGV[3]))
    local first = redis.call('ZRANGE', room, 0, 0, 'WITHSCORES')
    if first[2] then keep(math.ceil(tonumber(first[2]))) end
  end
end
return {seats, placeholders, soonest and tostring(soonest) or ''}
