-- bucket_mark: ask for a look at a scope by a given time, in a bucket of a cross-scope index.
-- Shared ground: scope_buckets.DueIndex.mark.
--
-- The score only ever comes forward: a later time than the one held changes nothing a look
-- needs. But a job may be between reading the score and settling it (bucket_settle.lua), and
-- its settle would raise or drop the score without knowing of this mark: so a mark ALWAYS
-- changes the score — to the time asked when that is sooner, else to a millisecond before the
-- time held — and the settle, which compares the score it read, then leaves it alone.
--
-- KEYS[1] the bucket   ZSET scope_id -> when to look (Redis seconds)
-- ARGV[1] member       ARGV[2] look by this time (Redis seconds)
--
-- returns the score now held (as a string)
local asked = tonumber(ARGV[2])
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
local score = asked
if held and tonumber(held) <= asked then score = tonumber(held) - 0.001 end
redis.call('ZADD', KEYS[1], score, ARGV[1])
return redis.call('ZSCORE', KEYS[1], ARGV[1])
