-- scope_put: write a scope's record (its entry: group, bot, template, generation) and write
-- or drop its resolve cache, in one step. Used by resolve (fill) and by config_sync (apply).
-- Every key is of the scope (its hash tag): the registry bucket and the scope indexes, which
-- span scopes, are written by the caller around this call (state.py: ScopeState._put).
--
-- KEYS[1] scope:{sid}:entry           STRING JSON [group_id, bot_id, template_id, generation]
-- KEYS[2] scope:{sid}:config          HASH resolve cache
-- ARGV[1] group_id   ARGV[2] bot_id   ARGV[3] template_id the scope's best rule names ("" = no
--         rule)   ARGV[4] generation   ARGV[5] cache: "write" (ARGV[6..] field, value ...) |
--         "drop"
--
-- Refused when the entry's own generation is newer than ARGV[4] (a later config_sync wrote the
-- scope already: the later state wins whatever order the calls land in). The checks against
-- config_gen, a key of no scope, are the caller's: apply reads it before (a newer generation
-- refuses), fill reads it after and drops what it wrote if it moved.
--
-- returns {1, the entry's template before ("" none)} written, {0, ""} refused. Replay-safe.
local gen = tonumber(ARGV[4])
local old = redis.call('GET', KEYS[1])
local before = old and cjson.decode(old) or nil
if before and tonumber(before[4] or 0) > gen then return {0, ''} end
redis.call('DEL', KEYS[2])
if ARGV[5] == 'write' then redis.call('HSET', KEYS[2], unpack(ARGV, 6)) end
redis.call('SET', KEYS[1], cjson.encode({ARGV[1], ARGV[2], ARGV[3], gen}))
return {1, before and before[3] or ''}
