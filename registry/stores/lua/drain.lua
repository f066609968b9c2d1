#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- drain_worker. KEYS[1] = lease. ARGV[4] = worker id.
-- Forgets the worker; returns its incarnation (now queued for the sweeper) or false.
local inc = redis.call('HGET', WORKERS, ARGV[4])
if not inc then return false end
redis.call('HDEL', WORKERS, ARGV[4])
retire(inc, now_ms())
return inc
