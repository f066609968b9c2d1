#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- The meta half of events/resync on Redis Cluster: validate, advance the
-- sequence, switch incarnations; the caller then writes the blocks node by node.
-- KEYS[1] = lease. ARGV[4..6] = worker id, epoch, mode; the last ARGV = nonce (fresh incarnation ids).
--   mode 'e' (events): ARGV[7..9] = seq, seq - 1, number of `cleared` events.
--     Returns {'ok', '', inc0, inc1, ...}: the incarnation before and after each clear.
--   mode 'r' (resync): ARGV[7..8] = first ('1'/'0'), the last_seq to set ('' unless last).
--     Returns {'ok', last_seq, inc}.
-- Or {'resync_needed', last_seq} | {'unknown_worker', ''}.
local wid, epoch, mode = ARGV[4], ARGV[5], ARGV[6]
local nonce = nonce_arg()
local now = now_ms()
local inc = live_inc(wid, epoch, now)
if not inc then return {'unknown_worker', ''} end
if mode == 'e' then
  local last = redis.call('HGET', inc_key(inc), 'seq')
  if last ~= ARGV[8] or stale_topology(inc) then return {'resync_needed', last} end
  local out = {'ok', '', inc}
  for _ = 1, tonumber(ARGV[9]) do
    inc = rotate(wid, inc, now, nonce)
    out[#out + 1] = inc
  end
  redis.call('HSET', inc_key(inc), 'seq', ARGV[7])
  return out
end
if ARGV[7] == '1' then
  inc = rotate(wid, inc, now, nonce)
  mark_topology(inc)
end
if ARGV[8] ~= '' then redis.call('HSET', inc_key(inc), 'seq', ARGV[8]) end
return {'ok', redis.call('HGET', inc_key(inc), 'seq'), inc}
