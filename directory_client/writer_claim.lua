-- Take or renew the lease naming the one bridge that writes a node's entries.
-- KEYS: writer lease; ARGV: owner id, ttl_ms.
-- Returns 1 if the caller renewed its lease, 2 if it took a free one (its entries may have been
-- cleared meanwhile: it must rewrite them), 0 if another bridge holds it.
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if cur then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 2
