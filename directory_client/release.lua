-- Give back one reservation; idempotent (a second release, or one after it ended, changes nothing).
-- KEYS: load, resv; ARGV: member ("token|prefill": the amount to give back is read from it,
-- so a caller cannot make the counters drift by passing a different number).
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'r', -1)
  -- its prefill still counts only if its first token is not due yet
  if redis.call('ZREM', KEYS[2], 'p:' .. ARGV[1]) == 1 then
    local tokens = tonumber(string.match(ARGV[1], '|(%d+)$')) or 0
    if tokens > 0 then redis.call('HINCRBY', KEYS[1], 't', 0 - tokens) end
  end
  return 1
end
return 0
