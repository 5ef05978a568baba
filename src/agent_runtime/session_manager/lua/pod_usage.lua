-- pod_usage (read only): for some pods of one scope, whether each is a placement candidate and
-- how many sessions it holds, in one call (reconcile asks about every pod; a pipelined
-- ZSCORE + SCARD per pod costs ~90 µs of client CPU in redis-py). Every key is of the scope.
--
-- KEYS[1] scope:{sid}:pods ZSET candidates
--   per pod, derived from ARGV[1]: pod:{sid}:{pod}:sessions SET
-- ARGV[1] key prefix "session_manager:"   ARGV[2] scope_id   ARGV[3 ..] pod ids
--
-- returns a flat list: for each pod in order, 1|0 (candidate), live sessions
local p, sid = ARGV[1], ARGV[2]
local out, k = {}, 0
for i = 3, #ARGV do
  local pod = ARGV[i]
  out[k + 1] = redis.call('ZSCORE', KEYS[1], pod) and 1 or 0
  out[k + 2] = redis.call('SCARD', pod_key(p, sid, pod, 'sessions'))
  k = k + 2
end
return out
