#!lua flags=allow-cross-slot-keys,no-writes
--!include _lib.lua
-- lookup, run on the node that holds the meta slot. KEYS[1] = lease.
-- ARGV[4..8] = requester ('' none), compat key ('' none), want all holders ('1'/'0'),
-- walk, kinds; ARGV[9..] = one entry per asked hash. kinds: one char per asked
-- hash, 'k' = its block set is on this node and the entry is the hash, 'm' =
-- another node's block set, already read, and the entry is its members joined by ','.
-- walk 'inc' (single node: every key is here, all kinds 'k'): the best holder
-- alone, among more than 32 holders of the first block, is found by binary
-- search on the prefix length (below); otherwise, up to 4 candidates each read their
-- prefix from their own wb set, one SMISMEMBER over many hashes each; walk
-- 'pos' (Cluster: wb sets live elsewhere), and many candidates on one node: one
-- SMISMEMBER of the candidates still holding per hash, over the hash's block
-- set or its inline members.
-- Returns {reason} or {'ok', matched, tied, holders}: `tied` = {wid, endpoint, tp}
-- of every candidate with the longest prefix and the lowest load among those
-- (the caller picks one with the tie breaker, ordering ids byte-wise, which Lua's
-- locale-dependent string comparison cannot promise); `holders` = {wid, endpoint,
-- tp, matched} of every candidate when asked for.
local requester, compat, want_all, by_inc, kinds = ARGV[4], ARGV[5], ARGV[6] == '1', ARGV[7] == 'inc', ARGV[8]
local n = #kinds
local P = {}
for i = 1, n do P[i] = ARGV[8 + i] end

local function members(i)
  if kinds:sub(i, i) == 'k' then return redis.call('SMEMBERS', BP .. P[i]) end
  local out = {}
  for inc in string.gmatch(P[i], '[^,]+') do out[#out + 1] = inc end
  return out
end

-- Flags (1/0), in the order of `ids`, for whether the block set of hash i holds each id.
local function holding(i, ids)
  if kinds:sub(i, i) == 'm' then
    local set, flags = {}, {}
    for inc in string.gmatch(P[i], '[^,]+') do set[inc] = true end
    for j, inc in ipairs(ids) do flags[j] = set[inc] and 1 or 0 end
    return flags
  end
  local key = BP .. P[i]
  if #ids == 1 then return {redis.call('SISMEMBER', key, ids[1])} end
  if #ids <= 1000 then return redis.call('SMISMEMBER', key, unpack(ids)) end
  local flags = {}  -- stay under Lua's unpack limit
  for s = 1, #ids, 1000 do
    local part = redis.call('SMISMEMBER', key, unpack(ids, s, math.min(s + 999, #ids)))
    for _, f in ipairs(part) do flags[#flags + 1] = f end
  end
  return flags
end

if compat == '' and requester ~= '' then
  local rinc = redis.call('HGET', WORKERS, requester)
  if rinc then compat = redis.call('HGET', inc_key(rinc), 'compat') or '' end
end
local now = now_ms()
local saw_self, saw_incompatible = false, false
-- A popular first block is held by much of the fleet: only what the filter needs is read for a
-- holder (nothing when there is no requester and no layout to match); the rest of a record is
-- read for the candidates that rank first.
local filtered = requester ~= '' or compat ~= ''

-- The incarnations in `incs` that may answer: current (a lease score in the future), not the
-- requester, of the layout asked for. Each becomes {inc = id, matched = 1}.
local function eligible(incs)
  local scores, out = {}, {}
  for s = 1, #incs, 1000 do  -- chunks stay under Lua's unpack limit
    for _, score in ipairs(redis.call('ZMSCORE', LEASE, unpack(incs, s, math.min(s + 999, #incs)))) do
      scores[#scores + 1] = score
    end
  end
  for k, inc in ipairs(incs) do
    local score = scores[k]   -- only current incarnations have one
    if score and tonumber(score) > now then
      local ok = true
      if filtered then
        local r = redis.call('HMGET', inc_key(inc), 'wid', 'compat')
        if r[1] == requester then
          saw_self, ok = true, false
        elseif compat ~= '' and r[2] ~= compat then
          saw_incompatible, ok = true, false
        end
      end
      if ok then out[#out + 1] = {inc = inc, matched = 1} end
    end
  end
  return out
end

local function no_candidate()
  if saw_incompatible then return {'incompatible_layout'} end
  if saw_self then return {'source_is_target'} end
  return {'no_candidate'}
end

-- The reply: the top candidates' records (lowest load among them), and every candidate's when asked.
local function answer(cands)
  local top = 0
  for _, c in ipairs(cands) do if c.matched > top then top = c.matched end end
  local low = nil
  for _, c in ipairs(cands) do
    if c.matched == top or want_all then
      local r = redis.call('HMGET', inc_key(c.inc), 'wid', 'load', 'endpoint', 'tp')
      c.wid, c.load, c.ep, c.tp = r[1], tonumber(r[2]), r[3], r[4]
    end
    if c.matched == top and (low == nil or c.load < low) then low = c.load end
  end
  local tied, holders = {}, {}
  for _, c in ipairs(cands) do
    if c.matched == top and c.load == low then tied[#tied + 1] = {c.wid, c.ep, c.tp} end
    if want_all then holders[#holders + 1] = {c.wid, c.ep, c.tp, c.matched} end
  end
  return {'ok', top, tied, holders}
end

-- How many of the asked hashes from the `from`-th to the `upto`-th, in order, `inc`'s wb set holds
-- before the first it lacks: a first chunk of 128, then doubling (to 4096, under Lua's unpack
-- limit), so a short run costs one call.
local function run_in_wb(inc, from, upto)
  local wb, m, s, size = wb_key(inc), 0, from, 128
  while s <= upto do
    local e = math.min(upto, s + size - 1)
    local flags = redis.call('SMISMEMBER', wb, unpack(P, s, e))
    for j = 1, #flags do
      if flags[j] ~= 1 then return m end
      m = m + 1
    end
    s, size = e + 1, math.min(size * 2, 4096)
  end
  return m
end

-- Up to 32 holders of the first block: walking each (below) is cheaper than searching.
if by_inc and not want_all and redis.call('SCARD', BP .. P[1]) > 32 then
  -- Single node, best holder only. The longest prefix some candidate holds whole, by binary search
  -- on its length p: a probe asks the holders of hash p, in turn, whether their own block list
  -- (wb) has hashes 1..p, and stops at the first that does, so a prefix most of the fleet holds
  -- costs a few candidates per probe, not each of them. Eligibility is read once per holder. The
  -- answer's tie is then among the first TIE_LIMIT holders of the whole prefix, not all of them.
  local TIE_LIMIT = 16
  local verdict = {}  -- inc -> true (a candidate) / false, read once per lookup

  -- Up to `limit` candidates holding hashes 1..p whole, from the holders of hash p, read a slice at a
  -- time (SSCAN) so a probe that finds its witnesses early reads no more of a large set.
  local function witnesses(p, limit)
    local found, taken, cursor = {}, {}, '0'
    repeat
      local page = redis.call('SSCAN', BP .. P[p], cursor, 'COUNT', 64)
      cursor = page[1]
      local fresh = {}
      for _, inc in ipairs(page[2]) do
        if verdict[inc] == nil then
          verdict[inc] = false
          fresh[#fresh + 1] = inc
        end
      end
      for _, c in ipairs(eligible(fresh)) do verdict[c.inc] = true end
      for _, inc in ipairs(page[2]) do
        if verdict[inc] and not taken[inc] and run_in_wb(inc, 1, p) == p then  -- SSCAN may repeat a member
          taken[inc] = true
          found[#found + 1] = {inc = inc, matched = p}
          if #found >= limit then return found end
        end
      end
    until cursor == '0'
    return found
  end

  local best = witnesses(n, TIE_LIMIT)
  if #best == 0 and n > 1 then
    local lo, hi, top = 1, n - 1, 0
    while lo <= hi do
      local mid = math.floor((lo + hi) / 2)
      if #witnesses(mid, 1) > 0 then
        top, lo = mid, mid + 1
      else
        hi = mid - 1
      end
    end
    if top > 0 then best = witnesses(top, TIE_LIMIT) end
  end
  if #best == 0 then return no_candidate() end
  return answer(best)
end

local cands = eligible(members(1))
if #cands == 0 then return no_candidate() end

-- A few candidates: each one's prefix from its own wb set (a call or two each). Many: hash by hash
-- over the candidates still holding on, so the work is the sum of how far each one holds, not
-- candidates x asked hashes.
if by_inc and #cands <= 4 then
  for _, c in ipairs(cands) do c.matched = 1 + run_in_wb(c.inc, 2, n) end
else
  -- Walk on while any candidate still holds the next hash; a candidate's
  -- `matched` is fixed when it drops out (or at the end, for the survivors).
  local alive, ids, i = cands, {}, 2
  for j, c in ipairs(cands) do ids[j] = c.inc end
  while i <= n do
    local flags = holding(i, ids)
    local dropped = false
    for j = 1, #flags do
      if flags[j] ~= 1 then dropped = true break end
    end
    if dropped then
      local keep, keep_ids = {}, {}
      for j, c in ipairs(alive) do
        if flags[j] == 1 then
          keep[#keep + 1], keep_ids[#keep_ids + 1] = c, c.inc
        else
          c.matched = i - 1
        end
      end
      alive, ids = keep, keep_ids
      if #alive == 0 then break end
    end
    i = i + 1
  end
  for _, c in ipairs(alive) do c.matched = i - 1 end
end
return answer(cands)
