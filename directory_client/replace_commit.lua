-- Swap a node's entries for the staged set in one step (lookups never see a half-written node).
-- KEYS: meta, blocks, staging; ARGV: keep_ms. A missing staging hash means "no blocks".
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('RENAME', KEYS[3], KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
else
  redis.call('DEL', KEYS[2])
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
