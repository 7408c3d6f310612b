-- Register (or re-register) a node and mark it alive. KEYS: meta, blocks; ARGV: info json, ttl_ms, keep_ms.
local now = now_ms()
redis.call('HSET', KEYS[1], 'info', ARGV[1], 'until', now + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return now
