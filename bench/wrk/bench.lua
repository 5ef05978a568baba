-- wrk script of the benches (bench/common.py runs it). Every request is a POST with a
-- unique request_id (the replay cache must never answer instead of the script).
--
-- Environment:
--   BENCH_MODE      route_existing | route_new | touch | touch_ids | noop
--                   route_existing / touch / noop: a random live session k in [0, SESSIONS)
--                   route_new: a new session per request (never placed before)
--                   touch_ids: touch naming the scope (bot_id + extra.group_id)
--   BENCH_SESSIONS  live sessions (ids "<BENCH_PREFIX><k>")   BENCH_SCOPES  scopes they span
--   BENCH_GROUP     extra.group_id; session k (or request n) is in bot "b-<k % SCOPES>"
--   BENCH_RUN       prefix making request ids (and route_new session ids) unique per run
-- Output: one line "BENCH_JSON {...}" (latencies in microseconds) from done().

local mode = os.getenv("BENCH_MODE") or "route_existing"
local sessions = tonumber(os.getenv("BENCH_SESSIONS") or "1")
local scopes = tonumber(os.getenv("BENCH_SCOPES") or "1")
local group = os.getenv("BENCH_GROUP") or "g-bench"
local prefix = os.getenv("BENCH_PREFIX") or "s-"
local run = os.getenv("BENCH_RUN") or "run"

local threads = {}
local counter = 0

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  math.randomseed((tid or 1) * 7919 + os.time())
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

local function route_body(rid, session, bot)
  return '{"metadata":{"request_id":"' .. rid .. '","session_id":"' .. session ..
    '","bot_id":"' .. bot .. '","extra":{"group_id":"' .. group .. '"}},"rawdata":{}}'
end

function request()
  counter = counter + 1
  local rid = run .. "-" .. (tid or 1) .. "-" .. counter
  if mode == "route_new" then
    local bot = "b-" .. (counter % scopes)
    return wrk.format(nil, nil, nil, route_body(rid, "n-" .. rid, bot))
  end
  local k = math.random(0, sessions - 1)
  local session = prefix .. k
  if mode == "touch" then
    return wrk.format(nil, nil, nil, '{"metadata":{"request_id":"' .. rid ..
      '","session_id":"' .. session .. '"},"rawdata":{}}')
  end
  if mode == "touch_ids" then
    return wrk.format(nil, nil, nil, '{"metadata":{"request_id":"' .. rid ..
      '","session_id":"' .. session .. '","bot_id":"b-' .. (k % scopes) ..
      '","extra":{"group_id":"' .. group .. '"}},"rawdata":{}}')
  end
  return wrk.format(nil, nil, nil, route_body(rid, session, "b-" .. (k % scopes)))
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_s":%.6f,"p50_us":%d,"p90_us":%d,"p99_us":%d,' ..
    '"p999_us":%d,"max_us":%d,"mean_us":%.1f,"errors":{"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d}}\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max, latency.mean,
    e.connect, e.read, e.write, e.status, e.timeout))
end
