#!lua flags=allow-cross-slot-keys
--!include _lib.lua
-- register_worker. KEYS[1] = lease (routes to the meta slot).
-- ARGV[4..12] = worker id, epoch, endpoint, fingerprint (canonical JSON), compat key, tp size, lease ms, kind,
-- nonce.
-- Returns {'new', ''} | {'renewed', last_seq} | {'stale', live_epoch} | {'conflict', live_epoch}.
local wid, epoch, endpoint, fp, compat, tp = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local ttl, kind, nonce = tonumber(ARGV[10]), ARGV[11], nonce_arg()
local now = now_ms()
local inc = redis.call('HGET', WORKERS, wid)
if inc then
  local score = redis.call('ZSCORE', LEASE, inc)
  if score and tonumber(score) > now then
    local old = redis.call('HMGET', inc_key(inc), 'epoch', 'endpoint', 'fp', 'seq', 'kind')
    if dec_lt(epoch, old[1]) then return {'stale', old[1]} end
    if epoch == old[1] then
      if endpoint ~= old[2] or fp ~= old[3] or kind ~= (old[5] or 'source') then return {'conflict', old[1]} end
      redis.call('ZADD', LEASE, now + ttl, inc)
      return {'renewed', old[4]}
    end
  end
  retire(inc, now)
end
local new = fresh_inc(nonce)
redis.call('HSET', inc_key(new), 'wid', wid, 'epoch', epoch, 'endpoint', endpoint, 'fp', fp,
           'compat', compat, 'tp', tp, 'seq', '0', 'load', '0', 'reg', now, 'kind', kind)
mark_topology(new)
redis.call('ZADD', LEASE, now + ttl, new)
redis.call('HSET', WORKERS, wid, new)
return {'new', ''}
