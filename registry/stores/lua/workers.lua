#!lua flags=allow-cross-slot-keys,no-writes
--!include _lib.lua
-- Worker records. KEYS[1] = lease. ARGV[4..] = worker ids (none: every worker).
-- Returns, per known worker, {wid, inc, ms left on the lease (negative: dead),
-- endpoint, epoch, fingerprint, last_seq, load, registered at ms, kind (false: stored before kinds were)}.
local wids = {}
if #ARGV >= 4 then
  for j = 4, #ARGV do wids[#wids + 1] = ARGV[j] end
else
  wids = redis.call('HKEYS', WORKERS)
end
local now = now_ms()
local out = {}
for _, wid in ipairs(wids) do
  local inc = redis.call('HGET', WORKERS, wid)
  if inc then
    local r = redis.call('HMGET', inc_key(inc), 'endpoint', 'epoch', 'fp', 'seq', 'load', 'reg', 'kind')
    local left = tonumber(redis.call('ZSCORE', LEASE, inc)) - now
    out[#out + 1] = {wid, inc, left, r[1], r[2], r[3], r[4], r[5], r[6], r[7]}
  end
end
return out
