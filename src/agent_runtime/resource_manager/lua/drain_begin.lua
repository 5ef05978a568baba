-- drain_begin: mark a pod as draining (or as pending: a replacement is warmed first) and take
-- it out of the warm pool in the same step, so no acquire can hand it out once it drains.
--
-- KEYS[1] resource:pod:{sid}:{pod}:info        HASH  (scope_id; phase becomes "draining")
-- KEYS[2] resource:pod:{sid}:{pod}:drain       HASH  deadline, trigger, since, state, scope_id
-- KEYS[3] resource:pod:{sid}:{pod}:idle_since  STRING
-- KEYS[4] resource:scope:{sid}:idle            SET   the scope's warm pool
-- ARGV[1] pod_id
-- ARGV[2] seconds from now to the deadline ("" when ARGV[3] gives it)
-- ARGV[3] the deadline itself, Unix seconds ("" when ARGV[2] gives it)
-- ARGV[4] trigger: admin | graceful_delete | cordon
-- ARGV[5] "draining" (at once) or "pending" (leaves the pool once its replacement is warm)
--
-- returns {"unknown"}                               the pod is not registered: nothing written
--         {"started"|"already", state, deadline, trigger}
--           started: this call began the drain; already: one was under way (idempotent).
--           A later call may only bring the deadline forward (a graceful deletion's kill
--           time beats an admin's or a cordon's default) and move pending to draining.
--
-- invariant: a pod whose drain state is "draining" is in no warm pool, has no idle_since and
-- its info's phase is "draining" (release.lua never puts it back); the deadline replied is
-- the drain's: the caller puts it into resource:draining:{bNN} (another slot). Replay-safe.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local deadline = ARGV[3] ~= '' and tonumber(ARGV[3]) or now + tonumber(ARGV[2])
local action = 'started'
local state = redis.call('HGET', KEYS[2], 'state')
local scope = redis.call('HGET', KEYS[1], 'scope_id') or ''
if state then
  action = 'already'
  local old = tonumber(redis.call('HGET', KEYS[2], 'deadline') or deadline)
  if deadline < old then
    redis.call('HSET', KEYS[2], 'deadline', string.format('%.6f', deadline))
  else
    deadline = old
  end
  if state == 'pending' and ARGV[5] == 'draining' then
    state = 'draining'
    redis.call('HSET', KEYS[2], 'state', state)
  end
else
  state = ARGV[5]
  redis.call('HSET', KEYS[2], 'deadline', string.format('%.6f', deadline), 'trigger', ARGV[4],
    'since', string.format('%.6f', now), 'state', state, 'scope_id', scope)
end
if state == 'draining' then
  redis.call('SREM', KEYS[4], ARGV[1])
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[1], 'phase', 'draining')
end
return {action, state, string.format('%.6f', deadline), redis.call('HGET', KEYS[2], 'trigger')}
