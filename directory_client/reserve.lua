-- Take load on a node atomically: every replica's next lookup sees it.
-- KEYS: load, resv; ARGV: member ("token|prefill"), prefill tokens, max_request_ms.
-- Both keys expire together at the latest reservation deadline: when they vanish, every
-- reservation in them had expired anyway, so counters and members never disagree.
local now = now_ms()
current_load(KEYS[1], KEYS[2], now)
local deadline = now + tonumber(ARGV[3])
-- NX + a unique member: a client retrying after a lost reply cannot count one request twice
if redis.call('ZADD', KEYS[2], 'NX', deadline, ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'r', 1)
redis.call('HINCRBY', KEYS[1], 't', ARGV[2])
for k = 1, 2 do
  if redis.call('PEXPIRETIME', KEYS[k]) < deadline then redis.call('PEXPIREAT', KEYS[k], deadline) end
end
return 1
