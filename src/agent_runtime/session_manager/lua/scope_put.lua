-- scope_put: register a scope (the registry entry and its index memberships) and write or drop
-- its resolve cache, in one step. Used by resolve (fill) and by config_sync (apply).
--
-- KEYS[1] config_gen                  STRING bumped by every config_sync (under its lock)
-- KEYS[2] scope_registry              HASH sid -> JSON [group_id, bot_id, template_id, gen]
-- KEYS[3] scope:{sid}:config          HASH resolve cache
-- ARGV[1] key prefix "session_manager:" (derives scope_index:template|group|bot:{id})
-- ARGV[2] scope_id   ARGV[3] group_id   ARGV[4] bot_id
-- ARGV[5] template_id the scope's best rule names ("" = no rule: in no template index)
-- ARGV[6] generation   ARGV[7] mode: "fill" | "apply"
-- ARGV[8] cache: "write" (ARGV[9..] field, value ...) | "drop"
--
-- fill : only while config_gen still equals ARGV[6] (read before the resolve's DB query): a
--        resolve racing a config_sync never writes back what it read before the DB write.
-- apply: only while ARGV[6] is still the newest generation (and the entry's own is not
--        newer): propagations of two config_syncs may overlap (the lock is not held for the
--        walk); a refused write is re-resolved from the DB at the newer generation, so the
--        later state wins for every scope, whatever order the calls land in. (Checked here,
--        not before the call: a later sync reads the indexes after its bump, so a scope this
--        write moves into its reach is either moved before that read or refused.)
--
-- returns 1 written, 0 refused (stale). Replay-safe.
local p, sid, group, bot, tid = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local gen, mode, cache = tonumber(ARGV[6]), ARGV[7], ARGV[8]

local old = redis.call('HGET', KEYS[2], sid)
local before = old and cjson.decode(old) or nil
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if mode == 'fill' then
  if current ~= gen then return 0 end
elseif current > gen or (before and tonumber(before[4] or 0) > gen) then
  return 0
end

if cache == 'write' then
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[3], unpack(ARGV, 9))
else
  redis.call('DEL', KEYS[3])
end

if before and before[3] and before[3] ~= '' and before[3] ~= tid then
  redis.call('SREM', p .. 'scope_index:template:' .. before[3], sid)
end
if tid ~= '' then redis.call('SADD', p .. 'scope_index:template:' .. tid, sid) end
redis.call('SADD', p .. 'scope_index:group:' .. group, sid)
redis.call('SADD', p .. 'scope_index:bot:' .. bot, sid)
redis.call('HSET', KEYS[2], sid, cjson.encode({group, bot, tid, gen}))
return 1
