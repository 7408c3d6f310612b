-- A node's info json if it is alive, else nil. KEYS: meta.
local m = redis.call('HMGET', KEYS[1], 'info', 'until')
if not m[1] or (tonumber(m[2]) or 0) <= now_ms() then return false end
return m[1]
