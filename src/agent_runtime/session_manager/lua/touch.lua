-- touch (uses _session.lua): keep a session of a scope alive by its own ttl, or end it (eos).
-- Every key is of the scope (its hash tag): the caller names the scope (the gateway's ids, or
-- the session-scope index it read).
--
-- KEYS[1] session:{sid}:{session_id}   HASH (scope_id, pod_id, expiry, session_ttl, index_until)
-- KEYS[2] scope:{sid}:session_expiry   ZSET
-- KEYS[3] touch:{sid}:{request_id}     STRING "touched,released,{fingerprint}" of an eos that
--         ended its session
-- ARGV[1] key prefix "session_manager:"   ARGV[2] session_id   ARGV[3] "1" = eos
-- ARGV[4] seconds that answer is kept for the same request re-sent (0: not kept, no
--         request_id)
-- ARGV[5] the request's fingerprint (state.request_hash of the session)
-- ARGV[6] scope_id
--
-- returns {touched, released, index}: touched 1 if the session was alive (eos: it was, and is
--         now ended), 0 if unknown in the scope or expired (an expired one is evicted on the
--         spot); released 1 if this call freed the slot; index: seconds to rewrite the
--         session-scope index with (0: not due)
--         {-1, 0, 0}: an eos whose request_id ended another session of the scope within
--         ARGV[4] s: nothing is done (the first answer belongs to that request)
--
-- invariant: the four places move together (evict_session); an expired session never
-- comes back to life. Replay: a re-sent touch extends again (harmless); a re-sent eos (its
-- reply lost: the same request_id) finds the session gone and answers what it did the first
-- time; another eos of an ended session answers {0, 0, 0}. Touch never moves the scope's
-- earliest expiry earlier (it only extends), so it never marks expiry_due.
local p, sid, eos, fingerprint, scope = ARGV[1], ARGV[2], ARGV[3] == '1', ARGV[5], ARGV[6]
local keep = eos and tonumber(ARGV[4]) > 0
local answer = keep and redis.call('GET', KEYS[3])
-- an answer without a fingerprint (written before answers were bound) counts as this one's
if answer and #answer > 3 and string.sub(answer, 5) ~= fingerprint then return {-1, 0, 0} end
local expiry = tonumber(redis.call('HGET', KEYS[1], 'expiry') or '-1')
if expiry < 0 then
  if answer then
    return {tonumber(string.sub(answer, 1, 1)), tonumber(string.sub(answer, 3, 3)), 0}
  end
  return {0, 0, 0}
end
local function ended(touched)
  evict_session(p, scope, sid, 0)
  if keep then
    redis.call('SET', KEYS[3], touched .. ',1,' .. fingerprint, 'EX', tonumber(ARGV[4]))
  end
  return {touched, 1, 0}
end
local now = redis_now()
if expiry <= now then return ended(0) end
if eos then return ended(1) end
local ttl = tonumber(redis.call('HGET', KEYS[1], 'session_ttl') or '0')
local new_expiry = now + ttl
redis.call('HSET', KEYS[1], 'expiry', string.format('%.6f', new_expiry))
redis.call('ZADD', KEYS[2], new_expiry, sid)
return {1, 0, index_due(KEYS[1], now, ttl)}
