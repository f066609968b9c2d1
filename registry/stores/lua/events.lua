#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- apply_events on a single node: validate and apply a whole batch atomically.
-- KEYS[1] = lease. ARGV[4..8] = worker id, epoch, seq, seq - 1, kinds (one char per
-- event: s stored, r removed, c cleared); then one hash count per event; then
-- every event's hashes in order; the last ARGV = nonce (fresh incarnation ids).
-- Returns {'ok', applied} | {'resync_needed', last_seq} | {'unknown_worker', ''}.
local wid, epoch, seq, prev, kinds = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local nonce = nonce_arg()
local now = now_ms()
local inc = live_inc(wid, epoch, now)
if not inc then return {'unknown_worker', ''} end
local last = redis.call('HGET', inc_key(inc), 'seq')
if last ~= prev or stale_topology(inc) then return {'resync_needed', last} end
local wb, applied, a = wb_key(inc), 0, 9 + #kinds
for e = 1, #kinds do
  local kind, n = kinds:sub(e, e), tonumber(ARGV[8 + e])
  -- wb:{inc} doubles as "already applied?": a repeated hash costs no block-set write.
  if kind == 's' or kind == 'r' then
    if n > 0 then apply_blocks(inc, wb, a, a + n - 1, kind == 's') end
  else
    local held = redis.call('SCARD', wb)
    applied = applied + held
    if held > 0 then
      inc = rotate(wid, inc, now, nonce)
      wb = wb_key(inc)
    end
  end
  applied, a = applied + n, a + n
end
redis.call('HSET', inc_key(inc), 'seq', seq)
return {'ok', applied}
