-- Shared by every registry script; the loader pastes it where a script says
-- `--!include _lib.lua`. Every script gets the same three leading ARGVs:
--   ARGV[1] meta prefix  "<prefix>{m}:"  (lease, workers, gone, ctr, i:<inc>; one slot)
--   ARGV[2] block prefix "<prefix>b:"    (b:<hash>  SET of incarnation ids)
--   ARGV[3] wb prefix    "<prefix>wb:"   (wb:{<inc>} SET of hashes, a slot per incarnation)
-- Numbers that may exceed 2^53 (epochs, sequence numbers) stay decimal strings.
local MP, BP, WP = ARGV[1], ARGV[2], ARGV[3]
local LEASE, WORKERS, GONE, CTR = MP .. 'lease', MP .. 'workers', MP .. 'gone', MP .. 'ctr'
local TOPO = MP .. 'topo'  -- which Redis processes hold the data now (set by the servers' sweepers)

-- Redis's clock, so every stateless server agrees on who is live.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function inc_key(inc) return MP .. 'i:' .. inc end
local function wb_key(inc) return WP .. '{' .. inc .. '}' end

-- a < b for non-negative integers written in decimal without leading zeros.
local function dec_lt(a, b)
  if #a ~= #b then return #a < #b end
  for i = 1, #a do
    local x, y = a:byte(i), b:byte(i)
    if x ~= y then return x < y end
  end
  return false
end

-- The worker's current incarnation if its lease runs and its epoch is `epoch`, else nil.
local function live_inc(wid, epoch, now)
  local inc = redis.call('HGET', WORKERS, wid)
  if not inc then return nil end
  local score = redis.call('ZSCORE', LEASE, inc)
  if not score or tonumber(score) <= now then return nil end
  if redis.call('HGET', inc_key(inc), 'epoch') ~= epoch then return nil end
  return inc
end

-- The nonce a script that makes incarnations was given as its last ARGV: 9 decimal digits the server drew
-- for this call. Read (and checked) before the script writes anything.
local function nonce_arg()
  local nonce = ARGV[#ARGV]
  if not nonce:match('^%d%d%d%d%d%d%d%d%d$') then error('the last ARGV must be a 9-digit nonce') end
  return nonce
end

-- A fresh incarnation id: the counter's next value, then the nonce. Ids must never repeat, whatever
-- Redis forgets: when the meta slot loses its last INCRs (a replica promoted before it had them, the
-- node restarted empty) the counter hands out values again, and a repeated id would inherit the old
-- incarnation's block memberships on the other nodes (lookups would name this worker for blocks it
-- never stored). With the nonce a repeated counter value makes a repeated id once in 10^9.
local function fresh_inc(nonce)
  return tostring(redis.call('INCR', CTR)) .. nonce
end

-- Add (`adding`) or remove ARGV[a .. b] to/from incarnation `inc` (its block list `wb` and each
-- hash's block set), where both live on this node. Per chunk of 1000 (under Lua's unpack limit):
-- one SMISMEMBER and one variadic SADD/SREM on wb, then one block-set write per hash whose
-- membership changed: about half the commands of a SADD-then-SADD per hash. A hash repeated in a
-- chunk gets its block-set write twice, which is idempotent.
local function apply_blocks(inc, wb, a, b, adding)
  local cmd, was = adding and 'SADD' or 'SREM', adding and 0 or 1
  for s = a, b, 1000 do
    local e = math.min(s + 999, b)
    local flags = redis.call('SMISMEMBER', wb, unpack(ARGV, s, e))
    redis.call(cmd, wb, unpack(ARGV, s, e))
    for k = 1, #flags do
      if flags[k] == was then redis.call(cmd, BP .. ARGV[s + k - 1], inc) end
    end
  end
end

-- Whether `inc` was filled under another Redis topology than the current one: a master failed over or
-- restarted since, and may have lost some of its writes, so the worker must resync. Never before any
-- server recorded a topology.
local function stale_topology(inc)
  local topo = redis.call('GET', TOPO)
  return topo and redis.call('HGET', inc_key(inc), 'topo') ~= topo
end

-- `inc` is (re)filled from now on under the current topology.
local function mark_topology(inc)
  local topo = redis.call('GET', TOPO)
  if topo then redis.call('HSET', inc_key(inc), 'topo', topo) end
end

-- Hide `inc` from lookups at once and queue its blocks for the sweeper.
local function retire(inc, now)
  redis.call('ZREM', LEASE, inc)
  redis.call('DEL', inc_key(inc))
  redis.call('ZADD', GONE, now, inc)
end

-- Move the worker to a fresh, empty incarnation with the same record and
-- lease: "drop every block" in O(1); the sweeper deletes the old blocks later.
local function rotate(wid, inc, now, nonce)
  local new = fresh_inc(nonce)
  redis.call('HSET', inc_key(new), unpack(redis.call('HGETALL', inc_key(inc))))
  redis.call('ZADD', LEASE, redis.call('ZSCORE', LEASE, inc), new)
  retire(inc, now)
  redis.call('HSET', WORKERS, wid, new)
  return new
end
