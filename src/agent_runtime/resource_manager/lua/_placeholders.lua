-- Shared by acquire.lua and placeholder.lua (prepended when the scripts are loaded).
-- A placeholder is "{token}@{deadline}" in resource:scope:{sid}:deploying: a deployer that
-- crashed leaves one behind, and it stops counting against max_pods at its deadline.

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

local function add_placeholder(key, token, now, lifetime)
  local member = token .. '@' .. tostring(now + lifetime)
  redis.call('SADD', key, member)
  return member
end
