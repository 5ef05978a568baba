-- pool_config: write a scope's pool config (one HSET: pool parameters, and with a pod spec its
-- deploy_ver and pod_spec_json together) and index the scope, unless a newer config_sync
-- already wrote it: overlapping propagations converge to the later one.
--
-- KEYS[1] resource:scope:{sid}:config      HASH (the contract's fields only)
-- KEYS[2] resource:scopes                  SET the scope index
-- KEYS[3] resource:scope:{sid}:config_gen  STRING the config_sync generation that wrote it
-- ARGV[1] scope_id   ARGV[2] config generation ("" = none: acquire's first write, which any
--         config_sync's write replaces)   ARGV[3..] field, value ...
--
-- returns 1 written, 0 refused (the stored generation is newer)
local gen = tonumber(ARGV[2])
if gen then
  if tonumber(redis.call('GET', KEYS[3]) or '0') > gen then return 0 end
  redis.call('SET', KEYS[3], ARGV[2])
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
