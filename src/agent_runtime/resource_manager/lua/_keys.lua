-- Key names a resource-manager script derives (prepended before the script and its other
-- preludes). Every key of one scope's state carries the scope id as its Redis Cluster hash
-- tag, braces included, so that a script touching one scope touches one slot. The layout is
-- spelled here once for Lua (and in state.py for Python).

-- prefix .. '{' .. sid .. '}:' .. what: with the scope prefix "resource_manager:resource:scope:"
-- a scope's key (config, pods, idle, deploying, deploy_followers:{id}, …), with the deploy
-- lock prefix "resource_manager:lock:rm:deploy:" a deploy's lock (what = the deploy id)
local function scope_key(prefix, sid, what) return prefix .. '{' .. sid .. '}:' .. what end

-- a pod's key: prefix "resource_manager:resource:pod:" .. '{' .. sid .. '}:' .. pod .. ':' ..
-- what (info, idle_since, health_fails, drain, reported): the pod's keys carry its scope's tag
local function pod_key(prefix, sid, pod, what)
  return prefix .. '{' .. sid .. '}:' .. pod .. ':' .. what
end
