-- touch (uses _session.lua): keep a session alive by its own ttl, or end it (eos).
--
-- KEYS[1] session:{session_id}   HASH (scope_id, pod_id, expiry, session_ttl)
-- KEYS[2] session_expiry         ZSET
-- ARGV[1] key prefix "session_manager:"   ARGV[2] session_id   ARGV[3] "1" = eos
--
-- returns {touched, released}: touched 1 if the session was alive (eos: it was, and is now
--         ended), 0 if unknown or expired (an expired one is evicted on the spot);
--         released 1 if this call freed the slot
--
-- invariant: the four places move together (evict_session); an expired session never
-- comes back to life. Replay: a re-sent touch extends again (harmless); a re-sent eos
-- answers {0, 0} — the session is already gone.
local p, sid = ARGV[1], ARGV[2]
local expiry = tonumber(redis.call('HGET', KEYS[1], 'expiry') or '-1')
if expiry < 0 then return {0, 0} end
local now = redis_now()
if expiry <= now then
  evict_session(p, KEYS[1], KEYS[2], sid, 0)
  return {0, 1}
end
if ARGV[3] == '1' then
  evict_session(p, KEYS[1], KEYS[2], sid, 0)
  return {1, 1}
end
local new_expiry = now + tonumber(redis.call('HGET', KEYS[1], 'session_ttl') or '0')
redis.call('HSET', KEYS[1], 'expiry', string.format('%.6f', new_expiry))
redis.call('ZADD', KEYS[2], new_expiry, sid)
return {1, 0}
