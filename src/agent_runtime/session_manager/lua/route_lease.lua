-- route_lease: what a route on its slow path holds — its pending replay marker, its
-- reservation, its queue seat — kept alive while it runs, or given back when it fails.
--
-- KEYS[1] route:{sid}:{request_id} STRING "pending:{token}\n{fingerprint}" while the route runs
-- KEYS[2] scope:{sid}:reserved     ZSET request_id -> lease deadline
-- KEYS[3] scope:{sid}:waiters      ZSET request_id -> deadline
-- ARGV[1] token   ARGV[2] request_id
-- ARGV[3] seconds: > 0 renew everything held for that long from now; 0 give it all back
--
-- returns 1 done, 0 not the owner (another call with this request_id holds the marker, or
--         it was answered already): nothing is touched — the reservation and seat, keyed by
--         request_id, are that call's now
--
-- invariant: only the caller whose token is in the marker renews or releases; a marker that
-- expired with nobody else's in its place still lets its last owner release (a route that
-- lost Redis for longer than the lease). Renewal never creates a seat or a reservation (XX).
-- Replay-safe: renewing twice or releasing twice changes nothing more.
local marker = redis.call('GET', KEYS[1])
local mine = 'pending:' .. ARGV[1]
local owner = marker == mine or (marker and string.sub(marker, 1, #mine + 1) == mine .. '\n')
local lease = tonumber(ARGV[3])
if lease > 0 then
  if not owner then return 0 end
  local t = redis.call('TIME')
  local deadline = tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease
  redis.call('PEXPIRE', KEYS[1], math.ceil(lease * 1000))
  redis.call('ZADD', KEYS[2], 'XX', deadline, ARGV[2])
  redis.call('ZADD', KEYS[3], 'XX', deadline, ARGV[2])
  return 1
end
if marker and not owner then return 0 end
if owner then redis.call('DEL', KEYS[1]) end
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
return 1
