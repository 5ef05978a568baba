-- deploy_time: record one successful deploy's duration (create to Ready, seconds) in the
-- scope's recent deploy times, newest first, capped: what a predictive warm pool reads a high
-- percentile of (warm_policy.py). Bounded: at most ARGV[2] entries, gone ARGV[3] seconds after
-- the last deploy.
--
-- KEYS[1] resource:scope:{sid}:deploy_times  LIST of seconds, newest first
-- ARGV[1] seconds   ARGV[2] how many are kept   ARGV[3] seconds the list outlives its last entry
--
-- returns the list's length
local seconds = tonumber(ARGV[1])
if not seconds or seconds < 0 or seconds ~= seconds then
  return redis.error_reply('deploy_time: not a duration: ' .. tostring(ARGV[1]))
end
redis.call('LPUSH', KEYS[1], string.format('%.3f', seconds))
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return redis.call('LLEN', KEYS[1])
