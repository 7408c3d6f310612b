-- Redis Cluster: one node's prefix and load; all its keys share the node's hash tag (one slot).
-- KEYS: meta, blocks, load, resv (its arrivals key is named beside resv); ARGV[1] key blob.
-- Reply: {info, held, worst, inflight, prefill, indexed, due_ms, arrivals, context tokens} or nil.
local keys, n = split_keys(ARGV[1])
local v = node_view(KEYS[1], KEYS[2], KEYS[3], KEYS[4], keys, n, now_ms())
if v == nil then return false end
return v
