#!lua flags=allow-cross-slot-keys,no-writes
--!include _lib.lua
-- The holders (incarnation ids) of each hash whose block set lives on THIS node.
-- KEYS[1] = one of the block keys. ARGV[4..] = hashes. Returns one array per hash.
local out = {}
for j = 4, #ARGV do out[#out + 1] = redis.call('SMEMBERS', BP .. ARGV[j]) end
return out
