-- bucket_due (read-only): the members of one bucket of a cross-scope index whose time has
-- come, by the Redis clock. Shared ground: scope_buckets.DueIndex.due.
--
-- KEYS[1] the bucket   ZSET scope_id -> when to look (Redis seconds)
-- ARGV[1] at most this many members (soonest first)
--
-- returns {member, score, member, score, ...}: each score as Redis stores it, the value
--         bucket_settle.lua compares to know that nothing marked the member since
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
