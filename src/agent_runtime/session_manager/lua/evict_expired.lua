-- evict_expired (uses _session.lua): the sweeper's expiry pass over one scope, a slice of it
-- per call. The sessions due are read and evicted in the same script, so a session that a
-- route or a touch extends in between (its expiry no longer due) is never evicted by a stale
-- read; and a slice of 50 evictions is one round trip instead of one per session.
--
-- KEYS[1] scope:{sid}:session_expiry   ZSET session_id → expiry (Redis seconds)
-- ARGV[1] key prefix "session_manager:" (derives session:{sid}:{id} and, per session, what
--         evict_session derives: scope:{sid}:sessions, pod:{sid}:{pod}:sessions, the channel)
-- ARGV[2] at most this many sessions (the oldest due first)   ARGV[3] scope_id
--
-- returns {next, id, id, ...}: the evicted session ids (fewer than ARGV[2]: nothing more is
--         due now), after `next`: the scope's earliest expiry left ("" when none), what the
--         caller settles the scope's expiry_due entry with
--
-- invariant: as evict: each session leaves its four places together, a waiter is signalled.
local p, sid = ARGV[1], ARGV[3]
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', redis_now(), 'LIMIT', 0, tonumber(ARGV[2]))
for _, session_id in ipairs(due) do
  evict_session(p, sid, session_id, 0)
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local out = {first[2] or ''}
for i, session_id in ipairs(due) do out[i + 1] = session_id end
return out
