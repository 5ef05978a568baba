-- deploy_follower_gate: take a seat in the scope's follower wait room, or be refused; a
-- seated follower calls it again to renew its seat (a lease, like the leader's).
--
-- KEYS[1] resource:scope:{sid}:deploy_followers  ZSET member -> deadline (Redis seconds)
-- KEYS[2] resource:leased_scopes                 SET  scopes the prune job looks at
-- ARGV[1] member (request_id of the waiting acquire)
-- ARGV[2] seconds this seat may be held unless renewed (the deploy lease)
-- ARGV[3] limit (pod_concurrency - 1: the leader's new pod has that many slots left)
-- ARGV[4] scope_id
--
-- returns 1 seated, 0 refused (the room is full; the seat was not kept)
--
-- invariant: ZCARD <= limit after every call. Add first, then leave again if over: never
-- "check then add", which lets two callers both see room for one. Seats of crashed
-- replicas expire by their deadline score, seconds later; the prune job (lease_prune.lua)
-- removes them where no other follower comes. Replay-safe: a re-sent call of a seated member
-- keeps its seat (its deadline renewed).
local now = tonumber(redis.call('TIME')[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[3]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('SADD', KEYS[2], ARGV[4])
return 1
