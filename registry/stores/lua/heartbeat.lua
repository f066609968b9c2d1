#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- heartbeat. KEYS[1] = lease. ARGV[4..7] = worker id, epoch, load, lease ms.
-- Returns 1 when the lease was renewed, 2 when it was renewed and the worker must resync (its blocks
-- were stored under another Redis topology: some may be lost), 0 when the worker is unknown, dead or of
-- another epoch.
local now = now_ms()
local inc = live_inc(ARGV[4], ARGV[5], now)
if not inc then return 0 end
redis.call('ZADD', LEASE, now + tonumber(ARGV[7]), inc)
redis.call('HSET', inc_key(inc), 'load', ARGV[6])
if stale_topology(inc) then return 2 end
return 1
