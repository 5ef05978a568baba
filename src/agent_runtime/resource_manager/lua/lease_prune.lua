-- lease_prune (uses _budget.lua, _placeholders.lua): the prune job's slice. Follower seats and
-- placeholders stop counting at their deadline in every script that counts them, but stay as
-- members until one of those runs for the scope; a replica that died leaves them behind in
-- scopes nobody routes to. This drops them, and the pod record of a leader that is gone once
-- its pod is registered (adopted by reconcile, or by a leader that registered it and died
-- before it ended its lease); a scope left with nothing leaves the index.
--
-- KEYS[1] resource:leased_scopes  SET  scopes that took a follower seat or a placeholder
-- KEYS[2] budget:pods             ZSET every budget unit
-- KEYS[3] resource:pods:all       SET  registered pods
-- ARGV[1] scope key prefix "resource_manager:resource:scope:" (derives {prefix}{sid}:config,
--         :deploying, :deploy_followers and :deploy_pod)
-- ARGV[2] rule budget prefix (derives {prefix}{budget_rule}:pods of the scope's linked rule)
-- ARGV[3] deploy lock prefix "resource_manager:lock:rm:deploy:" (derives {prefix}{sid})
-- ARGV[4 ..] scope ids (20 a call: ~8 commands each, ~0.3–0.5 ms in all)
--
-- returns {follower seats dropped, placeholders dropped}
--
-- invariant: only members past their deadline go (a placeholder with its budget units); a
-- record goes only without a live leader and once its pod is registered (one still starting
-- waits for a leader to take it over, or for its own expiry); a scope leaves the index only
-- when it holds none of them, in the same step (a gate or placeholder script that adds a
-- member adds the scope again). Replay-safe.
local now = tonumber(redis.call('TIME')[1])
local seats, placeholders = 0, 0
for i = 4, #ARGV do
  local sid = ARGV[i]
  local s = ARGV[1] .. sid .. ':'
  seats = seats + redis.call('ZREMRANGEBYSCORE', s .. 'deploy_followers', '-inf', '(' .. now)
  local before = redis.call('SCARD', s .. 'deploying')
  if before > 0 then
    local rule = redis.call('HGET', s .. 'config', 'budget_rule')
    sweep_placeholders(s .. 'deploying', '', now, sid, KEYS[2], rule_budget_key(ARGV[2], rule))
    placeholders = placeholders + before - redis.call('SCARD', s .. 'deploying')
  end
  local record = redis.call('HMGET', s .. 'deploy_pod', 'token', 'pod_id')
  if record[1] and redis.call('EXISTS', ARGV[3] .. sid) == 0
      and (not record[2] or redis.call('SISMEMBER', KEYS[3], record[2]) == 1) then
    redis.call('DEL', s .. 'deploy_pod')
    record[1] = false
  end
  if not record[1] and redis.call('ZCARD', s .. 'deploy_followers') == 0
      and redis.call('SCARD', s .. 'deploying') == 0 then
    redis.call('SREM', KEYS[1], sid)
  end
end
return {seats, placeholders}
