-- Take load on a node atomically: every replica's next lookup sees it.
-- KEYS: load, resv; ARGV: member ("token|prefill"), prefill tokens, max_request_ms,
-- max in-flight ("" = take it whatever the load). With a maximum this is compare-and-reserve:
-- a replica that decided on a load another replica has since added to gets -1 and decides again,
-- so two replicas deciding at once cannot both take the node they both saw idle.
-- Both keys expire together at the latest reservation deadline: when they vanish, every
-- reservation in them had expired anyway, so counters and members never disagree.
local now = now_ms()
local inflight = current_load(KEYS[1], KEYS[2], now)
-- a unique member: a client retrying after a lost reply cannot count one request twice
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
if ARGV[4] ~= '' and inflight > tonumber(ARGV[4]) then return -1 end
local deadline = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], deadline, ARGV[1])
redis.call('HINCRBY', KEYS[1], 'r', 1)
redis.call('HINCRBY', KEYS[1], 't', ARGV[2])
for k = 1, 2 do
  if redis.call('PEXPIRETIME', KEYS[k]) < deadline then redis.call('PEXPIREAT', KEYS[k], deadline) end
end
return 1
