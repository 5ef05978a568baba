-- Key names a session-manager script derives (prepended before the script and its other
-- preludes). Every key of one scope's state carries the scope id as its Redis Cluster hash
-- tag, braces included, so that a script touching one scope touches one slot. The layout is
-- spelled here once for Lua (and in state.py for Python); p is the prefix "session_manager:".

-- p .. 'scope:{' .. sid .. '}:' .. what   (sessions, session_expiry, pods, waiters,
-- reserved, arrivals, free)
local function scope_key(p, sid, what) return p .. 'scope:{' .. sid .. '}:' .. what end

-- p .. 'session:{' .. sid .. '}:' .. session_id   (the session's hash, in its scope)
local function session_key(p, sid, session_id)
  return p .. 'session:{' .. sid .. '}:' .. session_id
end

-- p .. 'previous_pod:{' .. sid .. '}:' .. session_id   (the tombstone of a pod that died)
local function previous_pod_key(p, sid, session_id)
  return p .. 'previous_pod:{' .. sid .. '}:' .. session_id
end

-- p .. 'pod:{' .. sid .. '}:' .. pod .. ':' .. what   (sessions, info, idle_notified)
local function pod_key(p, sid, pod, what)
  return p .. 'pod:{' .. sid .. '}:' .. pod .. ':' .. what
end
