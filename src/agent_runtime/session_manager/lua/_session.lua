-- Shared by evict.lua, evict_expired.lua, touch.lua and route_place.lua (prepended when they
-- are loaded, after _keys.lua). A session lives in one scope: its hash, its expiry entry and
-- its set memberships all carry the scope's tag; key names are derived from the prefix p
-- ("session_manager:") and the scope id with _keys.lua's builders.

-- Current Redis time in seconds, with microseconds.
local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Take a session of scope `sid` out of its four places at once and signal a waiter of the
-- scope. With `tombstone_ttl` > 0 the pod it was on is remembered, so its next route says
-- `rebound` (previous_pod:{sid}:{session_id}).
-- Returns the pod and the sessions left on it, or nil for a session unknown in the scope.
local function evict_session(p, sid, session_id, tombstone_ttl)
  local session = session_key(p, sid, session_id)
  local pod = redis.call('HGET', session, 'pod_id')
  redis.call('ZREM', scope_key(p, sid, 'session_expiry'), session_id)
  redis.call('DEL', session)
  if not pod then return nil end
  redis.call('SREM', scope_key(p, sid, 'sessions'), session_id)
  local pod_sessions = pod_key(p, sid, pod, 'sessions')
  redis.call('SREM', pod_sessions, session_id)
  if tombstone_ttl and tombstone_ttl > 0 then
    redis.call('SET', previous_pod_key(p, sid, session_id), pod, 'EX', math.ceil(tombstone_ttl))
  end
  redis.call('SPUBLISH', scope_key(p, sid, 'free'), session_id)
  return {pod, redis.call('SCARD', pod_sessions)}
end

-- The session-scope index (session_scope:{session_id} → sid, a key of no scope) is written by
-- the caller, not here: this says when. The hash keeps `index_until` (when the index the
-- caller last wrote lapses); with less than one session ttl left, a refresh is due: the new
-- lapse is recorded here and the seconds to write it with are returned (0: none due).
local function index_due(session, now, ttl)
  local until_ = tonumber(redis.call('HGET', session, 'index_until') or '0')
  if until_ >= now + ttl then return 0 end
  local seconds = math.ceil(2 * ttl)
  redis.call('HSET', session, 'index_until', string.format('%.6f', now + seconds))
  return seconds
end

-- Whether the scope's earliest expiry would move earlier with `expiry` (or the set is empty):
-- then the caller marks the scope's bucket of expiry_due (scope_buckets.DueIndex), which no
-- script of a scope can reach. Returns the time to mark ("" when nothing to mark).
local function due_mark(expiry_key, expiry)
  local first = redis.call('ZRANGE', expiry_key, 0, 0, 'WITHSCORES')
  if first[2] and tonumber(first[2]) <= expiry then return '' end
  return string.format('%.6f', expiry)
end
