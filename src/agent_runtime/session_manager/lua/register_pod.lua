-- register_pod: a pod handed out by the resource manager becomes a placement candidate.
--
-- KEYS[1] scope:{sid}:pods             ZSET candidates, score = arrival number
-- KEYS[2] scope:{sid}:pod_seq          STRING arrival counter
-- KEYS[3] pod:{sid}:{pod}:info         HASH (sse_url, deploy_ver, registered_at)
-- KEYS[4] pods:{sid}:registered         SET pod ids registered in the scope
-- KEYS[5] pod:{sid}:{pod}:idle_notified STRING
-- KEYS[6] scope:{sid}:config           HASH resolve cache (deploy_ver)
-- ARGV[1] key prefix "session_manager:" (derives the channel scope:{sid}:free)
-- ARGV[2] scope_id   ARGV[3] pod_id   ARGV[4] sse_url   ARGV[5] the pod's deploy_ver
--
-- returns 1 registered (or already a candidate: its arrival number is kept),
--         0 stale: the pod is not of the scope's current version (a deploy that started
--           before a deploy change); it is not made a candidate
--
-- invariant: scope:{sid}:pods ⊆ pods:{sid}:registered (every key is of the scope); a new candidate signals `free` so a waiting
-- route re-runs first-fit at once. Replay-safe.
local current = redis.call('HGET', KEYS[6], 'deploy_ver')
if current and current ~= ARGV[5] then return 0 end
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then return 1 end
local t = redis.call('TIME')
local seq = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], seq, ARGV[3])
redis.call('HSET', KEYS[3], 'sse_url', ARGV[4], 'deploy_ver', ARGV[5],
  'registered_at', string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000))
redis.call('SADD', KEYS[4], ARGV[3])
redis.call('DEL', KEYS[5])
redis.call('SPUBLISH', scope_key(ARGV[1], ARGV[2], 'free'), 'pod:' .. ARGV[3])
return 1
