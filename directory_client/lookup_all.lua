-- Single Redis: every live node's prefix and load in one EVALSHA.
-- KEYS[1] registry zset (node_id -> heartbeat deadline ms); ARGV[1] key prefix, ARGV[2] key blob,
-- ARGV[3] (optional) a session's key, whose value (its node, or '') ends the reply.
-- Per-node keys are built here rather than declared: allowed on a standalone Redis only
-- (the cluster backend runs lookup_node.lua once per node instead).
-- Reply: flat {node_id, info, held, worst_tier, inflight, prefill_tokens, indexed_blocks, due_ms, arrivals,
-- context tokens, ...}.
local now = now_ms()
local ids = redis.call('ZRANGE', KEYS[1], '(' .. now, '+inf', 'BYSCORE')
table.sort(ids)  -- byte order of UTF-8 = code point order = Python's sorted(str)
local keys, n = split_keys(ARGV[2])
local out = {}
for i = 1, #ids do
  local base = ARGV[1] .. ':{' .. ids[i] .. '}:'
  local v = node_view(base .. 'meta', base .. 'blocks', base .. 'load', base .. 'resv', keys, n, now)
  if v then
    out[#out + 1] = ids[i]
    for j = 1, 9 do out[#out + 1] = v[j] end
  end
end
if ARGV[3] then
  out[#out + 1] = redis.call('GET', ARGV[3]) or ''
end
return out
