#!lua flags=allow-cross-slot-keys,no-writes
--!include _lib.lua
-- lookup, run on the node that holds the meta slot. KEYS[1] = lease.
-- ARGV[4..7] = requester ('' none), compat key ('' none), want all holders ('1'/'0'),
-- kinds: one char per asked hash, 'k' = its block set is on this node and
-- ARGV[7+i] is the hash, 'm' = another node's block set, already read, and
-- ARGV[7+i] is its members joined by ','. (Single node: all 'k'.)
-- Returns {reason} or {'ok', matched, tied, holders}: `tied` = {wid, endpoint, tp}
-- of every candidate with the longest prefix and the lowest load among those
-- (the caller picks one with the tie breaker, ordering ids byte-wise, which Lua's
-- locale-dependent string comparison cannot promise); `holders` = {wid, endpoint,
-- tp, matched} of every candidate when asked for.
local requester, compat, want_all, kinds = ARGV[4], ARGV[5], ARGV[6] == '1', ARGV[7]

local function members(i)
  if kinds:sub(i, i) == 'k' then return redis.call('SMEMBERS', BP .. ARGV[7 + i]) end
  local out = {}
  for inc in string.gmatch(ARGV[7 + i], '[^,]+') do out[#out + 1] = inc end
  return out
end

-- The candidates still holding hash i: one SMISMEMBER (in chunks, under Lua's unpack limit).
local function still_holding(i, cands)
  local keep = {}
  if kinds:sub(i, i) == 'k' then
    for s = 1, #cands, 1000 do
      local ids = {}
      for j = s, math.min(s + 999, #cands) do ids[#ids + 1] = cands[j].inc end
      local flags = redis.call('SMISMEMBER', BP .. ARGV[7 + i], unpack(ids))
      for j = 1, #ids do
        if flags[j] == 1 then keep[#keep + 1] = cands[s + j - 1] end
      end
    end
  else
    local set = {}
    for inc in string.gmatch(ARGV[7 + i], '[^,]+') do set[inc] = true end
    for _, c in ipairs(cands) do
      if set[c.inc] then keep[#keep + 1] = c end
    end
  end
  return keep
end

if compat == '' and requester ~= '' then
  local rinc = redis.call('HGET', WORKERS, requester)
  if rinc then compat = redis.call('HGET', inc_key(rinc), 'compat') or '' end
end
local now = now_ms()
local cands, saw_self, saw_incompatible = {}, false, false
for _, inc in ipairs(members(1)) do
  local score = redis.call('ZSCORE', LEASE, inc)   -- only current incarnations have one
  if score and tonumber(score) > now then
    local r = redis.call('HMGET', inc_key(inc), 'wid', 'compat', 'load', 'endpoint', 'tp')
    if r[1] == requester then
      saw_self = true
    elseif compat ~= '' and r[2] ~= compat then
      saw_incompatible = true
    else
      cands[#cands + 1] = {inc = inc, wid = r[1], load = tonumber(r[3]), ep = r[4], tp = r[5], matched = 1}
    end
  end
end
if #cands == 0 then
  if saw_incompatible then return {'incompatible_layout'} end
  if saw_self then return {'source_is_target'} end
  return {'no_candidate'}
end

local alive = cands
for i = 2, #kinds do
  alive = still_holding(i, alive)
  if #alive == 0 then break end
  for _, c in ipairs(alive) do c.matched = i end
end

local top, low = 0, nil
for _, c in ipairs(cands) do if c.matched > top then top = c.matched end end
for _, c in ipairs(cands) do
  if c.matched == top and (low == nil or c.load < low) then low = c.load end
end
local tied, holders = {}, {}
for _, c in ipairs(cands) do
  if c.matched == top and c.load == low then tied[#tied + 1] = {c.wid, c.ep, c.tp} end
  if want_all then holders[#holders + 1] = {c.wid, c.ep, c.tp, c.matched} end
end
return {'ok', top, tied, holders}
