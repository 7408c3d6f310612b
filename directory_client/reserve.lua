-- Take load on a node atomically: every replica's next lookup sees it.
-- KEYS: load, resv (the node's arrivals key is named beside it); ARGV: member ("token|prefill", or
-- "token*n|prefill" for a request counting n in flight; "token~c..." for a request served whole
-- whose decode steps read c tokens of KV: counted in 'c' while it lasts), prefill tokens, ms until the reservation ends
-- by itself, ms until its prefill stops counting, max in-flight ("" = take it whatever the load),
-- and for a split whose KV is on its way here: "id|blocks", ms until it lands, ms until it ends.
-- With a maximum this is compare-and-reserve: a replica that decided on a load another replica
-- has since added to gets -1 and decides again, so two replicas deciding at once cannot both
-- take the node they both saw idle.
-- resv holds the member at its end time and, while its prefill counts, "p:" .. member at the
-- time of its first token; current_load retires both as they fall due, with no further call.
-- Both keys expire together at the latest end time: when they vanish, every reservation in them
-- had ended anyway, so counters and members never disagree.
local now = now_ms()
local inflight = current_load(KEYS[1], KEYS[2], now)
-- a unique member: a client retrying after a lost reply cannot count one request twice
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
-- released already: its answer was lost and the release got there first (release.lua)
if redis.call('ZSCORE', KEYS[2], 'x:' .. ARGV[1]) then return 0 end
if ARGV[5] ~= '' and inflight > tonumber(ARGV[5]) then return -1 end
local ends = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], ends, ARGV[1])
local prefill = tonumber(ARGV[2])
if prefill > 0 then
  local due = now + tonumber(ARGV[4])
  redis.call('ZADD', KEYS[2], due, 'p:' .. ARGV[1])
  -- the latest first token of any prefill reserved (a bound: a release does not lower it)
  if due > (tonumber(redis.call('HGET', KEYS[1], 's')) or 0) then redis.call('HSET', KEYS[1], 's', due) end
end
redis.call('HINCRBY', KEYS[1], 'r', weight(ARGV[1]))
local ctx = context(ARGV[1])
if ctx > 0 then redis.call('HINCRBY', KEYS[1], 'c', ctx) end
redis.call('HINCRBY', KEYS[1], 't', prefill)
for k = 1, 2 do
  if redis.call('PEXPIRETIME', KEYS[k]) < ends then redis.call('PEXPIREAT', KEYS[k], ends) end
end
-- The split arrival: every replica's lookups see it until its end; the node keeps the
-- MAX_ARRIVALS ending last, and the key vanishes with its last entry (a dead replica leaks nothing).
-- Written with pcall: a Redis user not yet allowed that key keeps its reserve (2: not recorded).
if ARGV[6] and ARGV[6] ~= '' then
  local arr, last = arr_key(KEYS[2]), now + tonumber(ARGV[8])
  local member = ARGV[6] .. '|' .. string.format('%d', now + tonumber(ARGV[7]))
  local ok = redis.pcall('ZADD', arr, last, member)
  if type(ok) == 'table' and ok.err then return 2 end
  redis.call('ZREMRANGEBYSCORE', arr, '-inf', now)
  local extra = redis.call('ZRANGE', arr, 0, -(MAX_ARRIVALS + 1))  -- soonest ends beyond the bound
  if #extra > 0 then redis.call('ZREM', arr, unpack(extra)) end
  -- lookups read arr while 'a' (the latest end) is ahead: load and resv live that long too, together
  if last > (tonumber(redis.call('HGET', KEYS[1], 'a')) or 0) then redis.call('HSET', KEYS[1], 'a', last) end
  for _, k in ipairs({KEYS[1], KEYS[2], arr}) do
    if redis.call('PEXPIRETIME', k) < last then redis.call('PEXPIREAT', k, last) end
  end
end
return 1
