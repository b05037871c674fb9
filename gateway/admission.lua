-- FairShare admission: one atomic call decides a request against four per-tenant limits.
--
-- KEYS (all hash-tagged with the tenant, e.g. fairshare:{acme}:rpm, so they share a cluster slot)
--   1 RPM bucket (hash: t = tokens, ts = last update in ms)
--   2 TPM bucket (hash: t, ts)
--   3 leases zset  (member = lease id, score = expiry time in ms)
--   4 leases hash  (field = lease id, value = tokens reserved in flight)
--   5 lease ends hash (field = lease id, value = the time in ms its request is expected to end)
-- ARGV
--   1 mode: "admit" (check and, only if every limit allows, charge) or "peek" (report only)
--   2 rpm limit (requests/min, -1 = unlimited)      3 tpm limit (tokens/min, -1 = unlimited)
--   4 max in-flight tokens (-1 = unlimited)         5 max concurrent requests (-1 = unlimited)
--   6 cost in tokens (prompt + max_tokens)          7 lease id            8 lease ttl (ms)
--   9 expected duration of this request in ms, stored as its lease's end (-1 = unknown)
--   10 the clock in ms (-1 = Redis TIME, the one clock for all gateways; tests and replays pass theirs)
--   11.. pairs (lease id, ms): the admitting gateway's current estimate of how long each of its
--        running leases of this tenant still needs (fresher than the stored ends; not stored)
-- Buckets (gateway/bucket.lua, prepended to this script) hold at most `limit` and refill
-- continuously at limit/60000 per ms; a missing bucket is full. Expired leases are dropped before
-- counting. A rejected request changes nothing but the removal of expired leases.
--
-- Retry hints (retry_after_ms): for the buckets, the exact refill time; for concurrency and
-- in-flight tokens, when enough running requests are expected to end (their leases' ends, from the
-- gateways' measured output rate and the tokens each still may produce, gateway/progress.py); a
-- lease without an estimate counts as ending at its expiry, one past its estimate as ending in
-- OVERDUE_MS.
--
-- Returns integers:
--   {admitted(0/1), reason, rpm_limit, rpm_remaining, rpm_reset_ms, tpm_limit, tpm_remaining,
--    tpm_reset_ms, retry_after_ms, inflight_tokens, concurrent}
--   reason: 0 ok, 1 requests/min, 2 tokens/min, 3 in-flight tokens, 4 concurrent requests,
--           5 cost exceeds the TPM limit itself, 6 cost exceeds the in-flight limit itself
local mode = ARGV[1]
local rpm_limit = tonumber(ARGV[2])
local tpm_limit = tonumber(ARGV[3])
local inflight_limit = tonumber(ARGV[4])
local conc_limit = tonumber(ARGV[5])
local cost = tonumber(ARGV[6])
local lease_id = ARGV[7]
local ttl_ms = tonumber(ARGV[8])

local expected_ms = tonumber(ARGV[9] or '-1')
local OVERDUE_MS = 1000

local now = clock_ms(ARGV[10])

local function fmt(x) return string.format('%.17g', x) end

-- drop expired leases
local zkey, hkey, ekey = KEYS[3], KEYS[4], KEYS[5]
local expired = redis.call('ZRANGEBYSCORE', zkey, '-inf', now)
if #expired > 0 then
  for i = 1, #expired, 1000 do
    redis.call('HDEL', hkey, unpack(expired, i, math.min(i + 999, #expired)))
    redis.call('HDEL', ekey, unpack(expired, i, math.min(i + 999, #expired)))
  end
  redis.call('ZREMRANGEBYSCORE', zkey, '-inf', now)
end
local concurrent = redis.call('ZCARD', zkey)
local inflight = 0
for _, v in ipairs(redis.call('HVALS', hkey)) do inflight = inflight + tonumber(v) end

local rpm_tokens, rpm_rate, tpm_tokens, tpm_rate = -1, 0, -1, 0
if rpm_limit >= 0 then rpm_tokens, rpm_rate = bucket_level(KEYS[1], rpm_limit, now) end
if tpm_limit >= 0 then tpm_tokens, tpm_rate = bucket_level(KEYS[2], tpm_limit, now) end

local function reset_ms(limit, tokens, rate)
  if limit < 0 then return 0 end
  return math.ceil((limit - tokens) / rate)
end

local function result(admitted, reason, retry_ms, rpm_left, tpm_left, inflight_now, conc_now)
  local rl, tl = -1, -1
  if rpm_limit >= 0 then rl = math.floor(rpm_left) end
  if tpm_limit >= 0 then tl = math.floor(tpm_left) end
  return {admitted, reason, rpm_limit, rl, reset_ms(rpm_limit, rpm_left, rpm_rate),
          tpm_limit, tl, reset_ms(tpm_limit, tpm_left, tpm_rate), math.ceil(retry_ms),
          inflight_now, conc_now}
end

if mode ~= 'admit' then
  return result(1, 0, 0, rpm_tokens, tpm_tokens, inflight, concurrent)
end

-- requests that can never be admitted, however long they wait
if tpm_limit >= 0 and cost > tpm_limit then
  return result(0, 5, 0, rpm_tokens, tpm_tokens, inflight, concurrent)
end
if inflight_limit >= 0 and cost > inflight_limit then
  return result(0, 6, 0, rpm_tokens, tpm_tokens, inflight, concurrent)
end

local reason, retry = 0, 0
-- HMGET of many fields, in slices (unpack has a stack limit)
local function hmget_all(key, ids)
  local out = {}
  for i = 1, #ids, 1000 do
    local part = redis.call('HMGET', key, unpack(ids, i, math.min(i + 999, #ids)))
    for _, v in ipairs(part) do out[#out + 1] = v end
  end
  return out
end
-- the running leases as {expected end ms, tokens}, soonest end first
local ends = nil
local function lease_ends()
  if ends then return ends end
  local hinted = {}
  for i = 11, #ARGV - 1, 2 do hinted[ARGV[i]] = tonumber(ARGV[i + 1]) end
  local live = redis.call('ZRANGE', zkey, 0, -1, 'WITHSCORES')
  local ids, expiry = {}, {}
  for i = 1, #live, 2 do ids[#ids + 1] = live[i]; expiry[#expiry + 1] = tonumber(live[i + 1]) end
  ends = {}
  if #ids == 0 then return ends end
  local stored, toks = hmget_all(ekey, ids), hmget_all(hkey, ids)
  for i, id in ipairs(ids) do
    local e = nil
    if hinted[id] then
      e = now + math.max(1, hinted[id])
    else
      e = tonumber(stored[i])
      if e == nil then e = expiry[i] elseif e <= now then e = now + OVERDUE_MS end
    end
    ends[#ends + 1] = {e, tonumber(toks[i]) or 0}
  end
  table.sort(ends, function(a, b) return a[1] < b[1] end)
  return ends
end
-- ms until `count` running requests have ended
local function wait_for_requests(count)
  local e = lease_ends()
  if count < 1 then return 1 end
  if count > #e then return OVERDUE_MS end
  return math.max(1, e[count][1] - now)
end
-- ms until running requests holding at least `tokens` in-flight tokens have ended
local function wait_for_tokens(tokens)
  local freed = 0
  for _, le in ipairs(lease_ends()) do
    freed = freed + le[2]
    if freed >= tokens then return math.max(1, le[1] - now) end
  end
  return OVERDUE_MS
end
if conc_limit >= 0 and concurrent + 1 > conc_limit then
  reason = 4; retry = math.max(retry, wait_for_requests(concurrent + 1 - conc_limit))
end
if inflight_limit >= 0 and inflight + cost > inflight_limit then
  reason = 3; retry = math.max(retry, wait_for_tokens(inflight + cost - inflight_limit))
end
if tpm_limit >= 0 and tpm_tokens < cost then
  reason = 2; retry = math.max(retry, (cost - tpm_tokens) / tpm_rate)
end
if rpm_limit >= 0 and rpm_tokens < 1 then
  reason = 1; retry = math.max(retry, (1 - rpm_tokens) / rpm_rate)
end
if reason ~= 0 then
  return result(0, reason, retry, rpm_tokens, tpm_tokens, inflight, concurrent)
end

-- admit: charge everything at once
if rpm_limit >= 0 then
  rpm_tokens = rpm_tokens - 1
  bucket_store(KEYS[1], rpm_limit, rpm_tokens, rpm_rate, now)
end
if tpm_limit >= 0 then
  tpm_tokens = tpm_tokens - cost
  bucket_store(KEYS[2], tpm_limit, tpm_tokens, tpm_rate, now)
end
redis.call('ZADD', zkey, now + ttl_ms, lease_id)
redis.call('HSET', hkey, lease_id, cost)
if expected_ms >= 0 then redis.call('HSET', ekey, lease_id, fmt(now + expected_ms)) end
for _, k in ipairs({zkey, hkey, ekey}) do
  if redis.call('PTTL', k) < ttl_ms + 1000 then redis.call('PEXPIRE', k, math.ceil(ttl_ms) + 1000) end
end
return result(1, 0, 0, rpm_tokens, tpm_tokens, inflight + cost, concurrent + 1)
