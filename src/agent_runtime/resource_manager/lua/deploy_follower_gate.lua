-- deploy_follower_gate: take a seat in the scope's follower wait room, or be refused.
--
-- KEYS[1] resource:scope:{sid}:deploy_followers  ZSET member -> deadline (Redis seconds)
-- ARGV[1] member (request_id of the waiting acquire)
-- ARGV[2] seconds this seat may be held (ready_timeout + 10)
-- ARGV[3] limit (pod_concurrency - 1: the leader's new pod has that many slots left)
--
-- returns 1 seated, 0 refused (the room is full; the seat was not kept)
--
-- invariant: ZCARD <= limit after every call. Add first, then leave again if over: never
-- "check then add", which lets two callers both see room for one. Seats of crashed
-- replicas expire by their deadline score.
local now = tonumber(redis.call('TIME')[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[3]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
return 1
