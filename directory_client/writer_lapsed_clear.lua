-- Clear a node's entries if a bridge wrote them (its meta notes "bridged") and no bridge holds its
-- writer lease any more (its bridge died: nothing keeps the entries true). Atomic with the lease
-- check, so a bridge that has just taken the lease and rewritten the node is never wiped. The
-- note is emptied with the entries, so only one caller clears (and counts the lapse); entries no
-- bridge ever wrote are left alone. KEYS: writer lease, blocks, meta. Returns 1 if cleared.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local bridged = redis.call('HGET', KEYS[3], 'bridged')
if not bridged or bridged == '' then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[3], 'bridged', '')
return 1
