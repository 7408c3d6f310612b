-- Node ids whose registry deadline has not passed. KEYS: registry.
return redis.call('ZRANGE', KEYS[1], '(' .. now_ms(), '+inf', 'BYSCORE')
