-- Shared helpers, prepended to every kvgate directory script.
-- Block entries: field = 8-byte big-endian block key, value = bitmask of tiers holding it
-- (bit 0 GPU, bit 1 CPU, bit 2 STORAGE). A block can sit in several tiers at once (vLLM offloads
-- a GPU block to CPU before evicting it), so removing one tier must not forget the others.

-- fastest tier of a tier bitmask, indexed by the stored string (saves a tonumber per block)
local FASTEST = {['1'] = 0, ['2'] = 1, ['3'] = 0, ['4'] = 2, ['5'] = 0, ['6'] = 1, ['7'] = 0}

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- split a blob of concatenated 8-byte keys into a Lua array (one string.sub per key)
local function split_keys(blob)
  local keys, n = {}, math.floor(#blob / 8)
  for i = 1, n do keys[i] = string.sub(blob, i * 8 - 7, i * 8) end
  return keys, n
end

-- how many leading keys a node holds and the slowest fastest-tier among them. HMGET in chunks
-- of doubling size: a node holding nothing costs one call with one field; one holding p blocks
-- costs ~log2(p) calls and < 2p field reads. Scanning every field (no binary search) is what
-- makes a hole in the middle of a prefix stop the count exactly where the engine would stop.
local function held_prefix(blocks, keys, n)
  local held, worst, lo, size = 0, 0, 1, 1
  while lo <= n do
    local hi = lo + size - 1
    if hi > n then hi = n end
    local vals = redis.call('HMGET', blocks, unpack(keys, lo, hi))
    for i = 1, #vals do
      local t = FASTEST[vals[i]]
      if t == nil then return held, worst end
      if t > worst then worst = t end
      held = held + 1
    end
    lo = hi + 1
    if size < 256 then size = size * 2 end
  end
  return held, worst
end

-- requests a reservation member counts: "token*n|prefill" n (a request generating n answers), else 1
local function weight(m)
  return tonumber(string.match(m, '%*(%d+)|%d+$')) or 1
end

-- KV tokens each decode step of a request served whole reads on its node, while its reservation
-- lasts: "token~c|prefill" or "token~c*n|prefill" c (before the weight: a script that predates it
-- still reads the weight and prefill right), else 0
local function context(m)
  return tonumber(string.match(m, '~(%d+)')) or 0
end

-- retire what fell due in resv and return the node's load counters and the ms until the last
-- queued prefill's first token is due (0 with nothing queued): a "p:token|prefill" member
-- due means that request's first token is due (its prefill stops counting); a "token|prefill"
-- member due means the reservation ended (its caller never sees the response end, or its
-- gateway replica died mid-request) and, if it still counted prefill, that too.
local function current_load(load, resv, now)
  local due = redis.call('ZRANGE', resv, '-inf', now, 'BYSCORE')
  if #due > 0 then
    redis.call('ZREMRANGEBYSCORE', resv, '-inf', now)
    local ended, tokens, ctx = 0, 0, 0
    for i = 1, #due do
      local m = due[i]
      local n = tonumber(string.match(m, '|(%d+)$')) or 0
      local head = string.sub(m, 1, 2)
      if head == 'p:' then
        tokens = tokens + n
      elseif head ~= 'x:' then  -- "x:": a release that came before its reserve (release.lua)
        ended = ended + weight(m)
        ctx = ctx + context(m)
        -- prefill settles no later than its reservation ends, but never count it twice
        if redis.call('ZREM', resv, 'p:' .. m) == 1 then tokens = tokens + n end
      end
    end
    if ended > 0 then redis.call('HINCRBY', load, 'r', 0 - ended) end
    if ctx > 0 then redis.call('HINCRBY', load, 'c', 0 - ctx) end
    -- "0 - x", not "-x": Lua's -0 reaches Redis as "-0", which HINCRBY rejects
    if tokens > 0 then redis.call('HINCRBY', load, 't', 0 - tokens) end
  end
  -- 'a': the latest end of a split arrival recorded on the node (reserve.lua), so that a lookup
  -- reads the arrivals key only while one may be live (most nodes never have one); 'c': the
  -- context tokens the answers served whole there read per decode step (reserve.lua)
  local l = redis.call('HMGET', load, 'r', 't', 's', 'a', 'c')
  local r, t, c = tonumber(l[1]) or 0, tonumber(l[2]) or 0, tonumber(l[5]) or 0
  if r < 0 then r = 0 end
  if t < 0 then t = 0 end
  if r == 0 and c ~= 0 then  -- nothing in flight, nothing answering: heals what a script that
    redis.call('HSET', load, 'c', 0)  -- predates 'c' left counted (it retires members without it)
    c = 0
  end
  if c < 0 then c = 0 end
  local due = 0
  if t > 0 then due = math.max((tonumber(l[3]) or now) - now, 0) end
  return r, t, due, (tonumber(l[4]) or 0) > now, c
end

-- split arrivals kept per decode node (directory_client.types.MAX_ARRIVALS_PER_NODE)
local MAX_ARRIVALS = 64

-- a node's arrivals key beside its resv key (same hash tag, so the same slot): named here rather
-- than declared, so a Redis user whose ACL predates it still runs lookups and reserves (it may
-- read every key under the prefix; writing it is tried with pcall, see reserve.lua)
local function arr_key(resv)
  return string.sub(resv, 1, -5) .. 'arr'
end

-- a decode node's split arrivals not done yet (arr: zset "id|blocks|lands_ms" -> ends ms), soonest
-- end first, as "id|blocks|ms until it lands|ms until it ends" (server clock: replicas agree)
local function arrivals_view(arr, now)
  local rows = redis.call('ZRANGE', arr, '(' .. now, '+inf', 'BYSCORE', 'LIMIT', 0, MAX_ARRIVALS, 'WITHSCORES')
  local out = {}
  for i = 1, #rows, 2 do
    local id, blocks, lands = string.match(rows[i], '^(.+)|(%d+)|(%d+)$')
    if id then
      out[#out + 1] = id .. '|' .. blocks .. '|' .. string.format('%d', tonumber(lands) - now)
        .. '|' .. string.format('%d', tonumber(rows[i + 1]) - now)
    end
  end
  return out
end

-- one live node's answer, or nil when it is dead or unknown: {info, held, worst_tier, inflight,
-- prefill, indexed blocks in all (HLEN: O(1)), ms until the prefill is due, split arrivals,
-- context tokens of the answers served whole there}
local function node_view(meta, blocks, load, resv, keys, n, now)
  local m = redis.call('HMGET', meta, 'info', 'until')
  if not m[1] or (tonumber(m[2]) or 0) <= now then return nil end
  local r, t, due, arriving, c = current_load(load, resv, now)
  local held, worst = held_prefix(blocks, keys, n)
  local arrivals = {}
  if arriving then arrivals = arrivals_view(arr_key(resv), now) end
  return {m[1], held, worst, r, t, redis.call('HLEN', blocks), due, arrivals, c}
end
