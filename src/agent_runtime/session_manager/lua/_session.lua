-- Shared by evict.lua, touch.lua and route_place.lua (prepended when they are loaded, after
-- _keys.lua). Key names are derived from the prefix p ("session_manager:") and the session's
-- own hash, with _keys.lua's builders.

-- Current Redis time in seconds, with microseconds.
local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Take a session out of its four places at once and signal a waiter of its scope. With
-- `tombstone_ttl` > 0 the pod it was on is remembered, so its next route says `rebound`: in
-- `tombstone_key` (route_place's: the route's scope), else in the session's scope.
-- Returns scope, pod and the sessions left on the pod, or nil for an unknown session.
local function evict_session(p, session_key, expiry_key, session_id, tombstone_ttl,
                             tombstone_key)
  local scope = redis.call('HGET', session_key, 'scope_id')
  local pod = redis.call('HGET', session_key, 'pod_id')
  redis.call('ZREM', expiry_key, session_id)
  redis.call('DEL', session_key)
  if not scope or not pod then return nil end
  redis.call('SREM', scope_key(p, scope, 'sessions'), session_id)
  local pod_sessions = pod_key(p, scope, pod, 'sessions')
  redis.call('SREM', pod_sessions, session_id)
  if tombstone_ttl and tombstone_ttl > 0 then
    redis.call('SET', tombstone_key or previous_pod_key(p, scope, session_id), pod, 'EX',
      math.ceil(tombstone_ttl))
  end
  redis.call('SPUBLISH', scope_key(p, scope, 'free'), session_id)
  return {scope, pod, redis.call('SCARD', pod_sessions)}
end
