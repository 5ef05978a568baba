-- scope_expire: the resource side of a scope leaves Redis if nothing of it is left: no pod (in
-- use or warm), no live placeholder (a deploy in flight), no cold deploy (live, or lapsed
-- with a pod to take over; each one's follower room expires on its own). Checked and deleted
-- in one step: an acquire either ran before (its placeholder or pod is here: kept) or after (it finds no config: "no_config", and writes the config it was given).
--
-- KEYS[1] resource:scope:{sid}:config   HASH
-- KEYS[2] resource:scope:{sid}:pods     ZSET
-- KEYS[3] resource:scope:{sid}:idle     SET
-- KEYS[4] resource:scope:{sid}:deploying SET "{token}@{deadline}"
-- KEYS[5] resource:scope:{sid}:cold_deploys ZSET deploy id -> first led (a cold deploy live,
--         or lapsed with a pod to take over; its lock, record and follower room hang off it)
-- KEYS[6] resource:scope:{sid}:config_gen STRING
--
-- returns 1 gone (expired now, or there was nothing: the caller takes the scope out of the
-- scope index, another slot), 0 kept (still in use)
local now = tonumber(redis.call('TIME')[1])
if redis.call('ZCARD', KEYS[2]) > 0 or redis.call('SCARD', KEYS[3]) > 0
    or redis.call('ZCARD', KEYS[5]) > 0 then
  return 0
end
for _, member in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  local deadline = tonumber(string.match(member, '@([^@]*)$') or '')
  if not deadline or deadline >= now then return 0 end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
return 1
