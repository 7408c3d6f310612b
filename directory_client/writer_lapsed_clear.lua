-- Clear a node's entries if no bridge holds its writer lease (its bridge died: nothing keeps the
-- entries true any more). Atomic with the lease check, so a bridge that has just taken the lease
-- and rewritten the node is never wiped. KEYS: writer lease, blocks. Returns 1 if cleared.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2])
return 1
