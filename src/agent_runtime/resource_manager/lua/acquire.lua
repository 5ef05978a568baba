-- acquire (uses _placeholders.lua): hand out a warm pod of the scope's current version, or
-- say "cold" (the caller claims a deploy: deploy_claim.lua, with its budget reservation).
-- The hot path: one script, the scope's slot only; a warm pod is counted in the budgets
-- already.
--
-- KEYS[1] resource:scope:{sid}:config     HASH  (deploy_ver, budget_rule)
-- KEYS[2] resource:scope:{sid}:idle       SET   warm pool
-- KEYS[3] resource:scope:{sid}:pods       ZSET  every pod of the scope
-- KEYS[4] resource:scope:{sid}:deploying  SET   placeholders "{token}@{deadline}"
-- KEYS[5] idem:{sid}:{request_id}         STRING cached acquire result (JSON, with its scope_id)
-- ARGV[1] pod key prefix "resource_manager:resource:pod:" (derives the warm pods'
--         resource:pod:{sid}:{pod}:info and :idle_since with pod_key: the scope's slot)
-- ARGV[2] placeholder token (unique per attempt; the same token on a re-sent call)
-- ARGV[3] idem TTL in seconds
-- ARGV[4] scope_id (written into the cached result)
-- ARGV[5] rule id the scope resolves through now ("" = none): the scope's link
--         (config field budget_rule) is set to it
--
-- returns {"cached", json}                 this request already got a pod (replay)
--         {"reuse", pod_id, pod_sse_url, deploy_ver}   a warm pod left the pool, now in use
--         {"no_config"}                    the scope has no pool config yet
--         {"cold"}                         no warm pod (or a re-sent call that holds a
--                                          placeholder already): claim a deploy
--         each with a last element "relink" when the link changed: the caller moves the
--         scope's budget units to the new rule (budget_link.lua, another slot)
local cached = redis.call('GET', KEYS[5])
if cached then return {'cached', cached} end  -- the key is the scope's: its own result
if redis.call('EXISTS', KEYS[1]) == 0 then return {'no_config'} end

local sid, rule = ARGV[4], ARGV[5]
local now = tonumber(redis.call('TIME')[1])
local function reply(r)
  if (redis.call('HGET', KEYS[1], 'budget_rule') or '') ~= rule then
    redis.call('HSET', KEYS[1], 'budget_rule', rule)
    r[#r + 1] = 'relink'
  end
  return r
end
if sweep_placeholders(KEYS[4], ARGV[2], now) then return reply({'cold'}) end

-- a config without deploy_ver matches no pod (HGET of a missing field is false on both sides)
local version = redis.call('HGET', KEYS[1], 'deploy_ver')
local best, best_since = nil, -1
for _, pod in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local info = pod_key(ARGV[1], sid, pod, 'info')
  if version and redis.call('HGET', info, 'deploy_ver') == version then
    local since = tonumber(redis.call('GET', pod_key(ARGV[1], sid, pod, 'idle_since')) or '0')
    if since > best_since then best, best_since = pod, since end  -- most recently idle first
  end
end
if best then
  local info = pod_key(ARGV[1], sid, best, 'info')
  redis.call('SREM', KEYS[2], best)
  redis.call('DEL', pod_key(ARGV[1], sid, best, 'idle_since'))
  redis.call('HSET', info, 'phase', 'in_use')
  local url = redis.call('HGET', info, 'pod_sse_url') or ''
  redis.call('SET', KEYS[5], cjson.encode({pod_id = best, pod_sse_url = url, deploy_ver = version,
    scope_id = ARGV[4]}), 'EX', tonumber(ARGV[3]))
  return reply({'reuse', best, url, version})
end
return reply({'cold'})
