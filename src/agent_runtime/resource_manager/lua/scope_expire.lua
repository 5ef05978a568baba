-- scope_expire: the resource side of a scope leaves Redis if nothing of it is left: no pod (in
-- use or warm), no live placeholder (a deploy in flight), no live follower seat, no deploy
-- lock. Checked and deleted in one step: an acquire either ran before (its placeholder or pod
-- is here: kept) or after (it finds no config: "no_config", and writes the config it was given).
--
-- KEYS[1] resource:scope:{sid}:config   HASH
-- KEYS[2] resource:scope:{sid}:pods     ZSET
-- KEYS[3] resource:scope:{sid}:idle     SET
-- KEYS[4] resource:scope:{sid}:deploying SET "{token}@{deadline}"
-- KEYS[5] resource:scope:{sid}:deploy_followers ZSET request_id -> deadline
-- KEYS[6] lock:rm:deploy:{sid}          STRING
-- KEYS[7] resource:scopes               SET the scope index
-- KEYS[8] resource:scope:{sid}:config_gen STRING
-- ARGV[1] scope_id
--
-- returns 1 gone (expired now, or there was nothing), 0 kept (still in use)
local now = tonumber(redis.call('TIME')[1])
if redis.call('ZCARD', KEYS[2]) > 0 or redis.call('SCARD', KEYS[3]) > 0
    or redis.call('EXISTS', KEYS[6]) == 1
    or redis.call('ZCOUNT', KEYS[5], now, '+inf') > 0 then
  return 0
end
for _, member in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  local deadline = tonumber(string.match(member, '@([^@]*)$') or '')
  if not deadline or deadline >= now then return 0 end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[8])
redis.call('SREM', KEYS[7], ARGV[1])
return 1
