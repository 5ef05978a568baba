-- pool_config: write a scope's pool config (one HSET: pool parameters, and with a pod spec its
-- deploy_ver and pod_spec_json together), unless a newer config_sync already wrote it:
-- overlapping propagations converge to the later one. The caller indexes the scope
-- (resource:scopes:{bNN}, another slot) when it was written.
--
-- KEYS[1] resource:scope:{sid}:config      HASH (the contract's fields only)
-- KEYS[2] resource:scope:{sid}:config_gen  STRING the config_sync generation that wrote it
-- ARGV[1] config generation ("" = none: acquire's first write, which any config_sync's write
--         replaces)   ARGV[2..] field, value ...
--
-- returns 1 written, 0 refused (the stored generation is newer)
local gen = tonumber(ARGV[1])
if gen then
  if tonumber(redis.call('GET', KEYS[2]) or '0') > gen then return 0 end
  redis.call('SET', KEYS[2], ARGV[1])
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
