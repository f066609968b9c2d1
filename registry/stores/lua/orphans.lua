#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- The meta half of the orphan audit. KEYS[1] = lease. ARGV[4] = '1' to queue the
-- orphans for the sweeper, '0' to only name them; ARGV[5..] = incarnation ids.
-- An id is an orphan when the meta slot knows nothing of it: not current (lease),
-- not queued for the sweeper (gone), no record. That happens only when the meta
-- slot lost writes (a failover, a restart without persistence) or a batch wrote a
-- block set after its incarnation was swept; ids never repeat (fresh_inc), so an
-- orphan never becomes current again and lookups already ignore it.
-- Returns the orphans among the ids.
local now, queue = now_ms(), ARGV[4] == '1'
local out = {}
for j = 5, #ARGV do
  local inc = ARGV[j]
  if not redis.call('ZSCORE', LEASE, inc) and not redis.call('ZSCORE', GONE, inc)
      and redis.call('EXISTS', inc_key(inc)) == 0 then
    out[#out + 1] = inc
    if queue then redis.call('ZADD', GONE, now, inc) end
  end
end
return out
