-- Add a tier bit to each block. KEYS: meta, blocks; ARGV: tier bit, keep_ms, key blob.
-- Read-modify-write in one script so concurrent writers of other tiers never lose a bit.
local bitv, keep = tonumber(ARGV[1]), tonumber(ARGV[2])
local keys, n = split_keys(ARGV[3])
local CHUNK = 1000
for lo = 1, n, CHUNK do
  local hi = math.min(lo + CHUNK - 1, n)
  local cur = redis.call('HMGET', KEYS[2], unpack(keys, lo, hi))
  local args, a = {}, 0
  for i = lo, hi do
    local old = tonumber(cur[i - lo + 1]) or 0
    local new = bit.bor(old, bitv)
    if new ~= old then
      args[a + 1] = keys[i]; args[a + 2] = new; a = a + 2
    end
  end
  if a > 0 then redis.call('HSET', KEYS[2], unpack(args, 1, a)) end
end
if n > 0 then redis.call('PEXPIRE', KEYS[2], keep) end
redis.call('PEXPIRE', KEYS[1], keep)
return n
