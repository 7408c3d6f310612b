-- Take or renew the lease naming the one bridge that writes a node's entries.
-- KEYS: writer lease, meta; ARGV: owner id, ttl_ms, keep_ms.
-- Returns 1 if the caller renewed its lease, 2 if it took a free one (its entries may have been
-- cleared meanwhile: it must rewrite them), 0 if another bridge holds it. The holder is also noted
-- in the node's meta ("bridged"; a meta made here lives keep_ms, as one made by registering does),
-- which outlives the lease as long as the node's entries may: a lapsed lease with that note is a
-- dead bridge's entries, whoever sees it later.
-- The lease is written first: a caller refused it (by the ACL) changes nothing.
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
local held = 2
if cur then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  held = 1
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
local registered = redis.call('EXISTS', KEYS[2])
redis.call('HSET', KEYS[2], 'bridged', ARGV[1])
if registered == 0 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return held
