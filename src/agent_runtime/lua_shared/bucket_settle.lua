-- bucket_settle: after a job looked at a member of a cross-scope index, set when to look next
-- (or drop it) — but only if nothing marked it since the job read it. Shared ground:
-- scope_buckets.DueIndex.settle.
--
-- A mark (ZADD LT, by whoever made the scope need a look sooner) and a settle may race: the
-- mark must win. So the settle compares the score it read (bucket_due.lua's string) with the
-- score now, and changes nothing when they differ: the mark stands, the member is looked at
-- again at the marked time.
--
-- KEYS[1] the bucket   ZSET scope_id -> when to look (Redis seconds)
-- ARGV[1] member       ARGV[2] the score the job read (as Redis gave it)
-- ARGV[3] when to look next (Redis seconds), or "" to drop the member
--
-- returns 1 settled, 0 left as it was (marked meanwhile, or gone)
local current = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not current or current ~= ARGV[2] then return 0 end
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], tonumber(ARGV[3]), ARGV[1])
end
return 1
