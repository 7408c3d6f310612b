-- Clear tier bits of each block; a block with no tier left is deleted.
-- KEYS: blocks; ARGV: bitmask to clear (7 = every tier), key blob.
local clear = tonumber(ARGV[1])
local keep_mask = bit.band(bit.bnot(clear), 7)
local keys, n = split_keys(ARGV[2])
local CHUNK = 1000
for lo = 1, n, CHUNK do
  local hi = math.min(lo + CHUNK - 1, n)
  local cur = redis.call('HMGET', KEYS[1], unpack(keys, lo, hi))
  local dels, d, sets, s = {}, 0, {}, 0
  for i = lo, hi do
    local old = tonumber(cur[i - lo + 1])
    if old then
      local new = bit.band(old, keep_mask)
      if new == 0 then
        d = d + 1; dels[d] = keys[i]
      elseif new ~= old then
        sets[s + 1] = keys[i]; sets[s + 2] = new; s = s + 2
      end
    end
  end
  if d > 0 then redis.call('HDEL', KEYS[1], unpack(dels, 1, d)) end
  if s > 0 then redis.call('HSET', KEYS[1], unpack(sets, 1, s)) end
end
return n
