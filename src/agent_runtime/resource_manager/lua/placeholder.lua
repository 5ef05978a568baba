-- placeholder (uses _placeholders.lua): reserve a deploy slot for a warm pod (autoscale).
-- Never touches the warm pool: refilling the floor must not consume a warm pod.
--
-- KEYS[1] resource:scope:{sid}:config     HASH (max_pods)
-- KEYS[2] resource:scope:{sid}:pods       ZSET
-- KEYS[3] resource:scope:{sid}:deploying  SET  placeholders "{token}@{deadline}"
-- ARGV[1] placeholder token (the same token on a re-sent call)
-- ARGV[2] placeholder lifetime in seconds
--
-- returns the placeholder member, or false when the scope has no config or is at max_pods
--
-- invariant: ZCARD pods + SCARD deploying <= max_pods.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local now = tonumber(redis.call('TIME')[1])
local mine = sweep_placeholders(KEYS[3], ARGV[1], now)
if mine then return mine end
local max_pods = tonumber(redis.call('HGET', KEYS[1], 'max_pods') or '0')
if redis.call('ZCARD', KEYS[2]) + redis.call('SCARD', KEYS[3]) >= max_pods then return false end
return add_placeholder(KEYS[3], ARGV[1], now, tonumber(ARGV[2]))
