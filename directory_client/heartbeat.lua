-- Extend a registered node's life. KEYS: meta, blocks; ARGV: ttl_ms, keep_ms. Returns 0 if unknown.
if redis.call('HEXISTS', KEYS[1], 'info') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'until', now_ms() + tonumber(ARGV[1]))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
return 1
