-- Mark a registered node dead now, keeping its entries for the retention (a re-registration
-- brings it back whole). KEYS: meta. The caller also sets its registry score to 0.
if redis.call('HEXISTS', KEYS[1], 'info') == 1 then redis.call('HSET', KEYS[1], 'until', 0) end
return 1
