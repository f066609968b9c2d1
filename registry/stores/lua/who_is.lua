#!lua flags=allow-cross-slot-keys,no-writes
--!include _lib.lua
-- For who_has: which worker each incarnation is, if it is still current.
-- KEYS[1] = lease. ARGV[4..] = incarnation ids.
-- Returns, per id, {worker id, 1 live / 0 dead}, or {} when superseded or gone.
local now = now_ms()
local out = {}
for j = 4, #ARGV do
  local score = redis.call('ZSCORE', LEASE, ARGV[j])
  if score then
    out[#out + 1] = {redis.call('HGET', inc_key(ARGV[j]), 'wid'), tonumber(score) > now and 1 or 0}
  else
    out[#out + 1] = {}
  end
end
return out
