-- Give back one reservation; idempotent (a second release, or one after it ended, changes nothing).
-- KEYS: load, resv; ARGV: member ("token|prefill": the amount to give back is read from it,
-- so a caller cannot make the counters drift by passing a different number), and optionally ms
-- until the reservation would end: given when the reserve's answer was lost, so the reserve may
-- still arrive after this release. Finding nothing then leaves "x:" .. member until that end, and
-- the late reserve, seeing it, takes nothing.
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'r', 0 - weight(ARGV[1]))
  -- its prefill still counts only if its first token is not due yet
  if redis.call('ZREM', KEYS[2], 'p:' .. ARGV[1]) == 1 then
    local tokens = tonumber(string.match(ARGV[1], '|(%d+)$')) or 0
    if tokens > 0 then redis.call('HINCRBY', KEYS[1], 't', 0 - tokens) end
  end
  return 1
end
if ARGV[2] and tonumber(ARGV[2]) > 0 then
  local ends = now_ms() + tonumber(ARGV[2])
  redis.call('ZADD', KEYS[2], ends, 'x:' .. ARGV[1])
  if redis.call('PEXPIRETIME', KEYS[2]) < ends then redis.call('PEXPIREAT', KEYS[2], ends) end
end
return 0
