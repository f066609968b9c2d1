#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- Add or remove one incarnation on many block sets that live on THIS node
-- (Redis Cluster ingest and every sweep). KEYS[1] = one of the block keys (routes
-- the call; a moved slot answers MOVED before anything runs).
-- ARGV[4] = incarnation, ARGV[5] = number of hashes to add; then the hashes to
-- add, then the hashes to remove. Idempotent, so a retry after a topology change is safe.
local inc, nadd = ARGV[4], tonumber(ARGV[5])
for j = 6, 5 + nadd do redis.call('SADD', BP .. ARGV[j], inc) end
for j = 6 + nadd, #ARGV do redis.call('SREM', BP .. ARGV[j], inc) end
return 1
