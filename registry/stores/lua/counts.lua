#!lua flags=allow-cross-slot-keys,no-writes
--!include _lib.lua
-- counts. KEYS[1] = lease. Returns {live workers, known workers, every incarnation
-- whose blocks are not swept yet (current ones, then queued ones)}.
local now = now_ms()
local incs = redis.call('ZRANGE', LEASE, 0, -1)
for _, inc in ipairs(redis.call('ZRANGE', GONE, 0, -1)) do incs[#incs + 1] = inc end
return {redis.call('ZCOUNT', LEASE, '(' .. now, '+inf'), redis.call('HLEN', WORKERS), incs}
