-- Token bucket: the one definition of the refill rule in Redis. Prepended to both scripts that
-- touch a bucket (gateway/admission.lua charges it, the settle script in gateway/redis_buckets.py
-- refunds it). `gateway.redis_buckets.bucket_level` / `bucket_wait_ms` are the same rule in Python,
-- for the local buckets a replica uses while Redis is down (gateway/local_buckets.py);
-- tests/integration/test_bucket_parity.py checks that both give the same decisions and retry
-- hints on random request sequences.
--
-- A bucket of `limit` holds at most `limit` and refills continuously at limit/60000 per ms; a
-- missing bucket is full. Stored as a hash: t = tokens, ts = time of the last update (ms).

-- tokens in the bucket at `now` (refilled), and its refill rate (per ms)
local function bucket_level(key, limit, now)
  local v = redis.call('HMGET', key, 't', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  local rate = limit / 60000.0
  if tokens == nil or ts == nil then return limit, rate end
  if now > ts then tokens = tokens + (now - ts) * rate end
  if tokens > limit then tokens = limit end
  return tokens, rate
end

-- store `tokens` as of `now`; the key expires once it would have refilled (a missing bucket is full)
local function bucket_store(key, limit, tokens, rate, now)
  redis.call('HSET', key, 't', string.format('%.17g', tokens), 'ts', string.format('%.17g', now))
  redis.call('PEXPIRE', key, math.ceil((limit - tokens) / rate) + 1000)
end

-- the scripts' clock (ms): the caller's `arg` when it is a number >= 0 (replays and tests drive time
-- explicitly), else Redis TIME (one clock for every gateway)
local function clock_ms(arg)
  local given = tonumber(arg or '-1')
  if given ~= nil and given >= 0 then return given end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end

