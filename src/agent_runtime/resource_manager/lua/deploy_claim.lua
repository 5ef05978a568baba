-- deploy_claim (uses _placeholders.lua): a cold acquire (the acquire script found
-- no warm pod) decides in one step whether it follows a deploy in flight or leads one, and
-- reserves the new pod's slot when it leads. In order:
--   1. the deploy of its own demand is live under another token: join it, whatever its room
--      (a duplicate of the request, or its own retry: one request never makes two deploys at
--      once). A deploy serves the demand its holder's token names (``{owner}/{demand}/{uuid}
--      @{start}``), not the one its id names: a takeover keeps the dead demand's id;
--   2. a live deploy of the scope whose follower room has a free seat (each deploy's pod holds
--      pod_concurrency sessions: its leader + pod_concurrency - 1 followers; those that left
--      with its pod count, follower_leave.lua): follow it;
--   3. a placeholder within max_pods, or else "coming" (a placeholder of a deploy in flight is
--      live: a pod may still come) or the refusal; the placeholder only with the caller's pod
--      budget reservation (budget_reserve.lua, the budget's own slot): without one (ARGV[14]
--      "0") the script answers "reserve" where it would add the placeholder, and the caller,
--      once it holds the unit, asks again with "1" (and gives the unit back unless it leads);
--   4. with it, take over a deploy whose lease lapsed with a pod nobody registered (its record
--      passes to us: adopt or delete), else lead a new deploy if the scope runs fewer than its
--      deploy concurrency, else give the placeholder back ("busy").
--
-- KEYS[1] resource:scope:{sid}:cold_deploys ZSET deploy id -> first led (Redis seconds)
-- KEYS[2] resource:scope:{sid}:deploying    SET  placeholders "{token}@{deadline}"
-- KEYS[3] resource:scope:{sid}:config       HASH (max_pods)
-- KEYS[4] resource:scope:{sid}:pods         ZSET the scope's pods (registered: a member)
-- ARGV[1] lock prefix "…lock:rm:deploy:{sid}:" (derives each deploy's lock {prefix}{id})
-- ARGV[2] scope prefix "…resource:scope:{sid}:" (derives {prefix}deploy_pod:{id} and
--         {prefix}deploy_followers:{id})
-- ARGV[3] deploy id of a new deploy (the demand's: the route's request id); when that id's
--         lock is held for another demand (a taker of our dead deploy), ARGV[6] is the id
-- ARGV[4] lock token "{replica}/{demand}/{uuid}@{acquire start}" (demand: ARGV[3], with "%",
--         "/" and "@" percent-encoded; a token without it serves the demand of its deploy id)
-- ARGV[5] lease in milliseconds (the lock lives at least this, and until its placeholder lapses)
-- ARGV[6] placeholder token (unique per attempt; the same on a re-sent call)
-- ARGV[7] follower member (the acquire's request id)   ARGV[8] seat hold in seconds
-- ARGV[9] seconds a follower room lives after its last seat was taken (ready_timeout + margin)
-- ARGV[10] the scope's deploy concurrency (live cold deploys at once)
-- ARGV[11] scope_id
-- ARGV[12] pod_concurrency (as the caller resolved the scope: sessions one pod holds)
-- ARGV[13] placeholder lifetime in seconds (the deploy lease: its leader renews it)
-- ARGV[14] "1": the caller holds the budget reservation of its placeholder token; "0": not yet
--
-- ("lead" and "follow": the caller marks the scope in the leased scopes' index)
-- returns {"lead", id, member}               a new deploy is ours (lock set, indexed; member:
--                                            its placeholder)
--         {"lead", id, member, pod_id, namespace, created, uid, cluster}
--                                            a lapsed deploy is ours, with its pod to adopt
--         {"follow", id, holder}             seated in that deploy's room (holder: its token)
--         {"busy"}                           the scope runs its deploy concurrency already
--         {"coming"}                         no slot for a pod, but a placeholder is live
--         {"max_reached"}                    no slot (ZCARD pods + live placeholders), none live
--         {"reserve", "1"|"0"}               (ARGV[14] "0") it would lead with a new
--                                            placeholder: reserve the budget unit and ask
--                                            again; "1": a placeholder is live (a refused
--                                            reservation is then "coming", not a refusal)
--
-- invariant: a live deploy has at most pod_concurrency - 1 seats (+ callers of its own
-- demand); live cold deploys <= concurrency (a renewal that takes a lapsed claim back may
-- pass it by its own deploy); ZCARD pods + SCARD deploying <= max_pods and a placeholder only
-- with its budget reservation; a lapsed deploy's pod passes to exactly one new
-- holder; only a leader holds a placeholder; a demand joins as its own only the deploy whose
-- holder serves it. Replay-safe: a re-sent call of a leader finds its own token on a lock (its
-- own deploy's or the one it took over, with its placeholder by its token) and is told "lead"
-- with that id again; a re-sent follower keeps its seat.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local second = tonumber(t[1])
local lock_prefix, prefix, own, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease_ms, ptoken, member = tonumber(ARGV[5]), ARGV[6], ARGV[7]
local room_limit = math.max(tonumber(ARGV[12]) - 1, 0)

-- the demand a lock token serves: its segment before the uuid (nil for a token without one)
local function demand_of(tok) return string.match(tok, '/([^/@]*)/[^/@]*@[^@]*$') end
local own_demand = demand_of(token)
local function serves_own(id, holder)
  local demand = demand_of(holder)
  if demand and own_demand then return demand == own_demand end
  return id == own
end

local function room(id) return prefix .. 'deploy_followers:' .. id end
local function record(id) return prefix .. 'deploy_pod:' .. id end

-- expired placeholders leave first; ours, on a re-sent call, is found
local mine = sweep_placeholders(KEYS[2], ptoken, second)

-- (its budget unit is the caller's to give back: another slot)
local function give_back_placeholder()
  if mine then redis.call('SREM', KEYS[2], mine) end
end

local function follow(id, holder)
  redis.call('ZADD', room(id), now + tonumber(ARGV[8]), member)
  redis.call('EXPIRE', room(id), tonumber(ARGV[9]))
  give_back_placeholder()
  return {'follow', id, holder}
end

-- followers that left with the deploy's pod (follower_leave.lua): their seats are gone, but
-- they hold the pod's places (its leader may still hold the lock, for its on_ready)
local function served(id) return tonumber(redis.call('HGET', record(id), 'served') or '0') end

-- a lapsed deploy's record naming a pod nobody registered (not a failure notice): inherited
local function orphan_of(id)
  local rec = redis.call('HMGET', record(id), 'token', 'pod_id', 'failed')
  return rec[1] and rec[2] and not rec[3] and not redis.call('ZSCORE', KEYS[4], rec[2])
end

-- the lock lapses with the placeholder (whole seconds: it counts through its deadline's
-- second), so a deploy whose lock lapsed holds no slot any more either
local function lead(id)
  local until_ms = (placeholder_deadline(mine) + 1) * 1000
  local now_ms = second * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('SET', lock_prefix .. id, token, 'PX', math.max(until_ms - now_ms, lease_ms))
  redis.call('ZADD', KEYS[1], 'NX', now, id)
  local rec = redis.call('HMGET', record(id), 'token', 'pod_id', 'namespace', 'created', 'uid',
    'cluster')
  if not rec[1] then return {'lead', id, mine} end
  if rec[1] ~= token then
    if not orphan_of(id) then
      redis.call('DEL', record(id))  -- a failure notice, or a pod registered by now
      return {'lead', id, mine}
    end
    redis.call('HSET', record(id), 'token', token)  -- keeps its expiry: the pod's deadline
  end
  if not rec[2] then return {'lead', id, mine} end
  return {'lead', id, mine, rec[2], rec[3] or '', rec[4] or '0', rec[5] or '', rec[6] or ''}
end

-- 1. our own demand's deploy (a re-sent call of its leader: the same answer)
local own_holder = redis.call('GET', lock_prefix .. own)
if own_holder and own_holder ~= token and serves_own(own, own_holder) then
  return follow(own, own_holder)
end
if own_holder == token and mine then return lead(own) end

-- 2. walk the scope's deploys: our own (under another id after a takeover, or the one a
-- re-sent call took over), count the live ones, find a free seat and a lapsed pod
local live, open, open_holder, orphan = 0, nil, nil, nil
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local holder = redis.call('GET', lock_prefix .. id)
  if holder == token and mine then return lead(id) end  -- a re-sent call: the same answer
  if holder and holder ~= token and serves_own(id, holder) then return follow(id, holder) end
  if holder then
    live = live + 1
    if not open and room_limit > 0 and holder ~= token then
      redis.call('ZREMRANGEBYSCORE', room(id), '-inf', '(' .. string.format('%.6f', now))
      if redis.call('ZCARD', room(id)) + served(id) < room_limit then
        open, open_holder = id, holder
      end
    end
  elseif orphan_of(id) then
    if not orphan or id == own then orphan = id end
  else
    redis.call('ZREM', KEYS[1], id)  -- ended, failed, or died before its create
  end
end
if open then return follow(open, open_holder) end

-- 3. a slot for a new pod
if not mine then
  local live_placeholders = redis.call('SCARD', KEYS[2])  -- swept: all live
  if at_max_pods(KEYS[3], KEYS[4], KEYS[2]) then
    if live_placeholders > 0 then return {'coming'} end
    return {'max_reached'}
  end
  if not orphan and live >= tonumber(ARGV[10]) then return {'busy'} end
  if ARGV[14] ~= '1' then return {'reserve', live_placeholders > 0 and '1' or '0'} end
  mine = add_placeholder(KEYS[2], ptoken, second, tonumber(ARGV[13]))
end

-- 4. lead: a lapsed deploy first (its pod is on its way already), else a new one
if orphan then return lead(orphan) end
if live >= tonumber(ARGV[10]) then
  give_back_placeholder()
  return {'busy'}
end
-- our demand's id may be held by the taker of our dead deploy (another demand's now): ours
-- is then led under this attempt's own id
if own_holder and own_holder ~= token then return lead(ptoken) end
return lead(own)
