-- route_place (uses _session.lua): the atomic core of route. One call decides and commits,
-- so a route for a known scope is one round trip whether it refreshes or places. Every key is
-- of the route's scope (its hash tag): one slot on a Redis Cluster.
--
-- KEYS[1] session:{sid}:{session_id}          HASH (scope_id, pod_id, expiry, session_ttl,
--         index_until)
-- KEYS[2] scope:{sid}:session_expiry          ZSET session_id -> expiry (Redis seconds)
-- KEYS[3] scope:{sid}:sessions                SET
-- KEYS[4] scope:{sid}:pods                    ZSET candidates in arrival order
-- KEYS[5] scope:{sid}:config                  HASH resolve cache (the scope's policy)
-- KEYS[6] pods:{sid}:registered               SET pod ids registered in the scope
-- KEYS[7] route:{sid}:{request_id}            STRING replay: the answer JSON (with the request's
--         fingerprint in its "request_hash" field), or "pending:{token}\n{fingerprint}"
-- KEYS[8] previous_pod:{sid}:{session_id}     STRING tombstone of a pod that died under it
--         (written by evict with pod_died, or here when the bound pod is no longer
--         registered; read for `rebound`, deleted when the session is placed again)
-- KEYS[9] scope:{sid}:reserved                ZSET request_id -> lease deadline: routes headed
--         for capacity being added (a pod being acquired); they count against the scope
--         like sessions, so waiters in the queue cannot take the slots they were promised
-- KEYS[10] scope:{sid}:waiters                ZSET the wait queue: a newcomer (not ARGV[8]) leaves
--         one free slot per live waiter; a placed waiter leaves the queue here
-- KEYS[11] scope:{sid}:arrivals               HASH the scope's arrival rate of new sessions: two
--         EWMAs (`fast`, `slow`, per second) and `at` (when last updated); a `placed` or
--         `rebound` answer counts one arrival (each needs a free slot: the warm pool's demand)
-- ARGV[1] key prefix "session_manager:" (derives pod:{sid}:{pod}:sessions|info|idle_notified,
--         scope:{sid}:free for the bound or chosen pod)
-- ARGV[2] session_id   ARGV[3] scope_id
-- ARGV[4] token of this request's caller (a caller that is still working on its request
--         passes its own token and is not told "in_flight")
-- ARGV[5] seconds an answer is kept for replay (60)
-- ARGV[6] seconds a pending marker or a reservation lives unless renewed (route_lease.lua)
-- ARGV[7] request_id
-- ARGV[8] "1" from the slow path: on placing, also leave the queue (a reservation is always
--         given back on placing)
-- ARGV[9] the request's fingerprint (state.request_hash: scope and session): a request_id
--         replays only for the request that used it first
-- ARGV[10] the fast EWMA's window (seconds)   ARGV[11] the slow one's   ARGV[12] seconds the
--         arrivals hash outlives its last arrival
--
-- returns {"replay", json}                   this request_id was answered already (json: the
--                                            first answer {pod_id, pod_sse_url, placement[,
--                                            previous_pod_id]}; cjson may escape "/" as "\/")
--         {"in_flight"}                      another call with this request_id is running
--         {"reused"}                         this request_id was used (answered or running) by
--                                            another request: nothing is done, nothing given
--         {"refresh", pod_id, sse_url, "", index, due}  binding kept, expiry extended by its
--                                            own ttl
--         {"placed", pod_id, sse_url, "", index, due}   new binding, committed in its four places
--         {"rebound", pod_id, sse_url, previous_pod_id, index, due}  new binding after its pod
--                                            died/left
--            index: seconds to (re)write the session-scope index with (0: not due; a new
--            binding always: the caller also learns the scope the index named before)
--            due: the time to mark in expiry_due ("": the scope's earliest expiry is not later)
--         {"need_config"}                    no policy cached (the request is marked pending)
--         {"need_acquire", deadline}         no candidate has room, the scope may grow: the
--                                            request now holds a reservation until deadline
--                                            (the caller marks leased_scopes; it is pending;
--                                            with ARGV[8] it also left the queue)
--         {"scope_full", reserved}           no room; reserved "1" when the request still
--                                            holds a reservation, else "" (it must queue)
--
-- invariant: SCARD scope:{sid}:sessions + live reservations <= scope_concurrency (when it
-- held before), and SCARD pod sessions <= pod_concurrency, after every call; a session is in
-- its four places or in none. Replay-safe: a re-sent call finds its own answer in KEYS[7].
-- A value without a fingerprint (written before answers were bound) replays as it did.
local p, sid, scope, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local replay_ttl, lease, rid, slow = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], ARGV[8] == '1'
local fingerprint = ARGV[9]
local fast_window, slow_window = tonumber(ARGV[10]), tonumber(ARGV[11])
local arrivals_ttl = tonumber(ARGV[12])

local cached = redis.call('GET', KEYS[7])
if cached then
  if string.sub(cached, 1, 8) ~= 'pending:' then
    local decoded, first = pcall(cjson.decode, cached)
    local owner = decoded and type(first) == 'table' and first.request_hash
    if owner and owner ~= fingerprint then return {'reused'} end
    return {'replay', cached}
  end
  local nl = string.find(cached, '\n', 9, true)
  if nl and string.sub(cached, nl + 1) ~= fingerprint then return {'reused'} end
  if string.sub(cached, 1, (nl or 0) - 1) ~= 'pending:' .. token then return {'in_flight'} end
end

-- a short lease: a caller that dies (or loses Redis) cannot hold up a retry for long
local function pending(outcome, detail)
  redis.call('SET', KEYS[7], 'pending:' .. token .. '\n' .. fingerprint, 'PX',
    math.ceil(lease * 1000))
  return {outcome, detail}
end

local function answer(placement, pod, url, previous, index, due)
  local reply = {pod_id = pod, pod_sse_url = url, placement = placement,
    request_hash = fingerprint}
  if previous then reply.previous_pod_id = previous end
  redis.call('SET', KEYS[7], cjson.encode(reply), 'EX', replay_ttl)
  return {placement, pod, url, previous or '', index, due}
end

local now = redis_now()
local previous = nil

-- (1) an existing binding
local bound = redis.call('HMGET', KEYS[1], 'scope_id', 'pod_id', 'expiry', 'session_ttl')
if bound[2] then
  local alive = tonumber(bound[3]) > now
  local registered = redis.call('SISMEMBER', KEYS[6], bound[2]) == 1
  if alive and registered then
    local ttl = tonumber(bound[4])
    local expiry = now + ttl
    redis.call('HSET', KEYS[1], 'expiry', string.format('%.6f', expiry))
    redis.call('ZADD', KEYS[2], expiry, sid)
    local url = redis.call('HGET', pod_key(p, scope, bound[2], 'info'), 'sse_url')
    return answer('refresh', bound[2], url or '', nil, index_due(KEYS[1], now, ttl), '')
  end
  -- expired (lazy) or pod gone. A pod that left is remembered in the tombstone like one that
  -- died: this call may answer need_* and the one that places later must still say `rebound`.
  local tombstone_ttl = 0
  if alive and not registered then
    previous = bound[2]
    tombstone_ttl = tonumber(bound[4])
  end
  evict_session(p, scope, sid, tombstone_ttl)
end
previous = previous or redis.call('GET', KEYS[8]) or nil

-- (2) the scope's policy, from the resolve cache
local policy = redis.call('HMGET', KEYS[5], 'scope_concurrency', 'pod_concurrency', 'max_pods',
  'session_ttl')
if not policy[1] then return pending('need_config') end
local scope_concurrency, pod_concurrency = tonumber(policy[1]), tonumber(policy[2])
local max_pods = tonumber(policy[3])
local sessions = redis.call('SCARD', KEYS[3])
-- reservations of other requests count like sessions (O(1) when there are none)
local reserved, mine = redis.call('ZCARD', KEYS[9]), false
if reserved > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', '(' .. now)
  mine = redis.call('ZSCORE', KEYS[9], rid) ~= false
  reserved = redis.call('ZCARD', KEYS[9])
  if mine then reserved = reserved - 1 end
end
local function full() return pending('scope_full', mine and '1' or '') end
if sessions + reserved >= scope_concurrency then return full() end
-- a newcomer does not jump the queue: it leaves a free slot to each live waiter (the slow
-- path's own calls are the waiters themselves)
if not slow and sessions + reserved + redis.call('ZCOUNT', KEYS[10], now, '+inf')
    >= scope_concurrency then
  return full()
end

-- (3) first-fit over the candidates in arrival order
local chosen = nil
for _, pod in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
  if redis.call('SCARD', pod_key(p, scope, pod, 'sessions')) < pod_concurrency then
    chosen = pod
    break
  end
end
if not chosen then
  -- the scope may grow by a pod: reserve a slot of it (bounded by what max_pods can hold)
  if redis.call('ZCARD', KEYS[4]) < max_pods
      and sessions + reserved < math.min(scope_concurrency, max_pods * pod_concurrency) then
    redis.call('ZADD', KEYS[9], now + lease, rid)
    if slow then redis.call('ZREM', KEYS[10], rid) end  -- out of the queue: it has a slot
    return pending('need_acquire', string.format('%.6f', now + lease))
  end
  return full()
end

-- (4) commit the four places at once
local ttl = tonumber(policy[4])
local expiry = now + ttl
local due = due_mark(KEYS[2], expiry)
local index = math.ceil(2 * ttl)
redis.call('HSET', KEYS[1], 'scope_id', scope, 'pod_id', chosen,
  'expiry', string.format('%.6f', expiry), 'session_ttl', ttl,
  'index_until', string.format('%.6f', now + index))
redis.call('ZADD', KEYS[2], expiry, sid)
redis.call('SADD', KEYS[3], sid)
redis.call('SADD', pod_key(p, scope, chosen, 'sessions'), sid)
redis.call('DEL', pod_key(p, scope, chosen, 'idle_notified'), KEYS[8])
if mine then redis.call('ZREM', KEYS[9], rid) end
if slow then redis.call('ZREM', KEYS[10], rid) end
-- (5) one more arrival in the scope's rates (a replay returned above: counted once)
local rates = redis.call('HMGET', KEYS[11], 'fast', 'slow', 'at')
local since = math.max(now - (tonumber(rates[3]) or now), 0)
local fast = (tonumber(rates[1]) or 0) * math.exp(-since / fast_window) + 1 / fast_window
local slow = (tonumber(rates[2]) or 0) * math.exp(-since / slow_window) + 1 / slow_window
redis.call('HSET', KEYS[11], 'fast', string.format('%.9g', fast),
  'slow', string.format('%.9g', slow), 'at', string.format('%.6f', now))
redis.call('EXPIRE', KEYS[11], arrivals_ttl)
local url = redis.call('HGET', pod_key(p, scope, chosen, 'info'), 'sse_url') or ''
if previous then return answer('rebound', chosen, url, previous, index, due) end
return answer('placed', chosen, url, nil, index, due)
