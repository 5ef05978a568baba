-- pod_usage (read only): for many registered pods, whether each is a placement candidate and
-- how many sessions it holds, in one call (reconcile asks about every pod; a pipelined
-- ZSCORE + SCARD per pod costs ~90 µs of client CPU in redis-py).
--
-- KEYS (derived from ARGV[1], per member): scope:{sid}:pods ZSET, pod:{sid}:{pod}:sessions SET
-- ARGV[1] key prefix "session_manager:"
-- ARGV[2 ..] members "{sid}:{pod}"
--
-- returns a flat list: for each member in order, 1|0 (candidate), live sessions
local p = ARGV[1]
local out, k = {}, 0
for i = 2, #ARGV do
  local member = ARGV[i]
  local colon = string.find(member, ':', 1, true) or 0
  local sid, pod = string.sub(member, 1, colon - 1), string.sub(member, colon + 1)
  local candidate = redis.call('ZSCORE', scope_key(p, sid, 'pods'), pod) and 1 or 0
  out[k + 1] = candidate
  out[k + 2] = redis.call('SCARD', pod_key(p, sid, pod, 'sessions'))
  k = k + 2
end
return out
