-- lease_prune (uses _budget.lua, _placeholders.lua): the prune job's slice. Follower seats and
-- placeholders stop counting at their deadline in every script that counts them, but stay as
-- members until one of those runs for the scope; a replica that died leaves them behind in
-- scopes nobody routes to. This drops them, and a cold deploy whose leader is gone from the
-- scope's deploy index once nothing is left to take over: it died before its create, or its
-- pod is registered (adopted by reconcile, or registered by a leader that died before it ended
-- its lease: its record goes too); a scope left with nothing leaves the leased index.
--
-- KEYS[1] resource:leased_scopes  SET  scopes that took a follower seat or a placeholder
-- KEYS[2] budget:pods             ZSET every budget unit
-- KEYS[3] resource:pods:all       SET  registered pods
-- ARGV[1] scope key prefix "resource_manager:resource:scope:" (derives {prefix}{sid}:config,
--         :deploying, :cold_deploys, and per deploy :deploy_followers:{id}, :deploy_pod:{id})
-- ARGV[2] rule budget prefix (derives {prefix}{budget_rule}:pods of the scope's linked rule)
-- ARGV[3] deploy lock prefix "resource_manager:lock:rm:deploy:" (derives {prefix}{sid}:{id})
-- ARGV[4 ..] scope ids (20 a call: ~8 commands each, + ~4 a cold deploy in flight)
--
-- returns {follower seats dropped, placeholders dropped}
--
-- invariant: only members past their deadline go (a placeholder with its budget units); a
-- deploy leaves the index only without a live leader and with nothing to take over (a pod
-- still starting waits for a leader to take it over, or for its record's own expiry); a scope
-- leaves the leased index only when it holds none of them, in the same step (a gate, claim or
-- placeholder script that adds a member adds the scope again). Replay-safe.
local now = tonumber(redis.call('TIME')[1])
local seats, placeholders = 0, 0
for i = 4, #ARGV do
  local sid = ARGV[i]
  local s = scope_key(ARGV[1], sid, '')
  local before = redis.call('SCARD', s .. 'deploying')
  if before > 0 then
    local rule = redis.call('HGET', s .. 'config', 'budget_rule')
    sweep_placeholders(s .. 'deploying', '', now, sid, KEYS[2], rule_budget_key(ARGV[2], rule))
    placeholders = placeholders + before - redis.call('SCARD', s .. 'deploying')
  end
  for _, id in ipairs(redis.call('ZRANGE', s .. 'cold_deploys', 0, -1)) do
    seats = seats + redis.call('ZREMRANGEBYSCORE', s .. 'deploy_followers:' .. id, '-inf',
      '(' .. now)
    if redis.call('EXISTS', scope_key(ARGV[3], sid, id)) == 0 then
      local record = redis.call('HMGET', s .. 'deploy_pod:' .. id, 'token', 'pod_id', 'failed')
      if not record[1] or record[3] or not record[2]
          or redis.call('SISMEMBER', KEYS[3], record[2]) == 1 then
        if record[2] and not record[3] then redis.call('DEL', s .. 'deploy_pod:' .. id) end
        redis.call('ZREM', s .. 'cold_deploys', id)
      end
    end
  end
  if redis.call('ZCARD', s .. 'cold_deploys') == 0
      and redis.call('SCARD', s .. 'deploying') == 0 then
    redis.call('SREM', KEYS[1], sid)
  end
end
return {seats, placeholders}
