-- A routed request's prefill is done: keep it in flight, stop counting its prompt as queued.
-- KEYS: load, resv; ARGV: member ("token|prefill"), new member ("token|0").
-- One atomic step (not release + reserve): other replicas never see the request counted twice,
-- or not at all. Returns 1, or 0 when the reservation had already expired or been released.
local deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not deadline then return 0 end
local tokens = tonumber(string.match(ARGV[1], '|(%d+)$')) or 0
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[2], deadline, ARGV[2])
if tokens > 0 then redis.call('HINCRBY', KEYS[1], 't', 0 - tokens) end
return 1
