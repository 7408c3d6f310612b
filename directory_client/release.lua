-- Give back one reservation; idempotent (a second release, or one after it ended, changes nothing).
-- KEYS: load, resv (the node's arrivals key is named beside it); ARGV: member ("token|prefill":
-- the amounts to give back are read from it, so a caller cannot make the counters drift by
-- passing a different number), optionally ms until the reservation would end ("" or absent:
-- none), and optionally the id of the split arrival the reserve recorded. The ms are given when
-- the reserve's answer was lost, so the reserve may still arrive after this release. Finding
-- nothing then leaves "x:" .. member until that end, and the late reserve, seeing it, takes nothing.
-- A released split has answered: its arrival leaves the node's arrivals (tried with pcall, like
-- its write: a Redis user not allowed that key still releases, and the entry expires by itself).
if ARGV[3] and ARGV[3] ~= '' then
  local arr, head = arr_key(KEYS[2]), ARGV[3] .. '|'
  local rows = redis.call('ZRANGE', arr, 0, -1)
  for i = 1, #rows do
    if string.sub(rows[i], 1, #head) == head then redis.pcall('ZREM', arr, rows[i]) end
  end
end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'r', 0 - weight(ARGV[1]))
  local ctx = context(ARGV[1])
  if ctx > 0 then redis.call('HINCRBY', KEYS[1], 'c', 0 - ctx) end
  -- its prefill still counts only if its first token is not due yet
  if redis.call('ZREM', KEYS[2], 'p:' .. ARGV[1]) == 1 then
    local tokens = tonumber(string.match(ARGV[1], '|(%d+)$')) or 0
    if tokens > 0 then redis.call('HINCRBY', KEYS[1], 't', 0 - tokens) end
  end
  return 1
end
local lost = tonumber(ARGV[2] or '')
if lost and lost > 0 then
  local ends = now_ms() + lost
  redis.call('ZADD', KEYS[2], ends, 'x:' .. ARGV[1])
  if redis.call('PEXPIRETIME', KEYS[2]) < ends then redis.call('PEXPIREAT', KEYS[2], ends) end
end
return 0
