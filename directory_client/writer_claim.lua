-- Take or renew the lease naming the one bridge that writes a node's entries.
-- KEYS: writer lease; ARGV: owner id, ttl_ms. Returns 1 if the caller holds the lease now, else 0.
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if cur then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
