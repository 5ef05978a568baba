-- Shared by acquire.lua, placeholder.lua, adopt.lua, deploy_claim.lua, deploy_lease.lua and
-- lease_prune.lua (prepended when the scripts are loaded). A placeholder is "{token}@{deadline}"
-- in resource:scope:{sid}:deploying, its deadline a short lease that its deployer renews
-- (deploy_lease.lua): a deployer that died leaves one behind, and it stops counting against
-- max_pods at its deadline, seconds later. Its pod budget unit is a reservation in the
-- budget's own slot (budget_reserve.lua), taken before the placeholder and lapsing with it.

local function placeholder_deadline(member)
  local at = string.find(member, '@[^@]*$')
  return at and tonumber(string.sub(member, at + 1)) or 0
end

-- Drop expired placeholders (the caller's own too: an expired one no longer reserves a slot);
-- return the unexpired member already holding `token` (a re-sent call), or nil.
local function sweep_placeholders(key, token, now)
  local mine = nil
  for _, member in ipairs(redis.call('SMEMBERS', key)) do
    local at = string.find(member, '@[^@]*$')
    local deadline = at and tonumber(string.sub(member, at + 1)) or 0
    if deadline < now then
      redis.call('SREM', key, member)
    elseif string.sub(member, 1, at - 1) == token then
      mine = member
    end
  end
  return mine
end

-- whether the scope holds max_pods already: its pods and its (unexpired: swept first)
-- placeholders; a config without max_pods holds none
local function at_max_pods(config, pods, deploying)
  local max_pods = tonumber(redis.call('HGET', config, 'max_pods') or '0')
  return redis.call('ZCARD', pods) + redis.call('SCARD', deploying) >= max_pods
end

-- (the caller marks the scope in the leased scopes' index, where the prune job finds it:
-- another slot, so not here)
local function add_placeholder(key, token, now, lifetime)
  local member = token .. '@' .. tostring(now + lifetime)
  redis.call('SADD', key, member)
  return member
end
