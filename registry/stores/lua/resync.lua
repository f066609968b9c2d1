#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- resync on a single node, one chunk atomically. KEYS[1] = lease.
-- ARGV[4..7] = worker id, epoch, first ('1'/'0'), the last_seq to set ('' unless
-- this is the last chunk); ARGV[8..] = hashes; the last ARGV = nonce (fresh incarnation ids).
-- Returns {'ok', last_seq, blocks} | {'unknown_worker', '', 0}.
local wid, nonce = ARGV[4], nonce_arg()
local now = now_ms()
local inc = live_inc(wid, ARGV[5], now)
if not inc then return {'unknown_worker', '', 0} end
if ARGV[6] == '1' then
  if redis.call('SCARD', wb_key(inc)) > 0 then inc = rotate(wid, inc, now, nonce) end
  mark_topology(inc)
end
local wb = wb_key(inc)
if #ARGV - 1 >= 8 then apply_blocks(inc, wb, 8, #ARGV - 1, true) end
if ARGV[7] ~= '' then redis.call('HSET', inc_key(inc), 'seq', ARGV[7]) end
return {'ok', redis.call('HGET', inc_key(inc), 'seq'), redis.call('SCARD', wb)}
