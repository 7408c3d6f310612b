-- Record a node's heartbeat deadline in the registry (the list of nodes to ask), dropping nodes
-- dead for longer than the retention. KEYS: registry; ARGV: node_id, ttl_ms, retention_ms.
local now = now_ms()
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
return 1
