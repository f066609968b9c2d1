#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- The meta half of sweep. KEYS[1] = lease. ARGV[4..5] = max incarnations, grace ms.
-- Forgets up to max workers whose lease lapsed (their incarnation joins the
-- sweep queue), then returns up to max queued incarnations retired at least
-- `grace` ms ago, whose blocks the caller deletes. Safe to run concurrently.
local max, grace = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
for _, inc in ipairs(redis.call('ZRANGEBYSCORE', LEASE, '-inf', now, 'LIMIT', 0, max)) do
  local wid = redis.call('HGET', inc_key(inc), 'wid')
  if wid and redis.call('HGET', WORKERS, wid) == inc then redis.call('HDEL', WORKERS, wid) end
  retire(inc, now)
end
return redis.call('ZRANGEBYSCORE', GONE, '-inf', now - grace, 'LIMIT', 0, max)
