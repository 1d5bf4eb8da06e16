// keel/store/internal/redis_scripts.hpp — the Lua scripts behind keel::redis_store.
//
// Each store operation is one script on one key (a hash), so it runs
// atomically on the server and a Redis Cluster routes it by that key's hash
// tag. Every script reads the server's clock with TIME (microseconds; Lua
// numbers are doubles, exact to 2^53 us) plus ARGV[1], a test-only offset
// (0 in production), checks owner and fence before it writes anything, and
// sets the key's PEXPIRE to the end of what it must remember plus
// `forget_after` (ARGV: last), so Redis itself collects dead keys.
//
// Record hash fields: q request digest, s state (0 in flight, 1 committed,
// 2 abandoned), o owner (16 bytes), f fence, le lease end, re record end;
// committed: di id, md model digest, pr policy revision, r result, ec error
// code, em error message, ca commit time. The fence lives in the record's
// own hash, so it is always in the record's hash slot.
//
// Lease hash fields: o owner, f fence, e end, h held (1/0).
//
// A key with no hash (never claimed, or forgotten forget_after after it
// ended) gets its first fence from the server clock: `now` in microseconds.
// Every fence the key had before was issued at least forget_after (>= 1 s)
// of that clock earlier, and a key cannot take a new owner more than once a
// microsecond (each claim is one script, and Redis runs one script at a
// time), so the new fence is above all of them: fences never go backwards
// for a key, whatever Redis forgot — unless the server's clock was stepped
// back by more than forget_after while the key lived. Fences of keys the
// store still has go up by 1 per new owner, as on every backend
// (redis_fences::sequential), or to max(fence + 1, now) (from_clock: a
// fence is then a time, so one handed out by a primary whose writes a
// failover lost stays below the promoted replica's later fences). The
// scripts call nextf(fence); the fence prelude defines it per mode.
// Result hash fields: v value, e end (0: kept until erased).
#pragma once

namespace keel::detail {

inline constexpr const char* redis_lua_prelude = R"lua(
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
local function num(x) return string.format('%.0f', x) end
local function keep(key, until_us, forget)
  local ms = math.ceil((until_us - now + forget) / 1000)
  if ms < 1 then ms = 1 end
  redis.call('PEXPIRE', key, ms)
end
)lua";

// The next owner's fence, per redis_fences (defined after the prelude).
inline constexpr const char* redis_lua_fence_sequential = R"lua(
local function nextf(f) return f + 1 end
)lua";
inline constexpr const char* redis_lua_fence_from_clock = R"lua(
local function nextf(f) return math.max(f + 1, now) end
)lua";

// ARGV: 1 offset, 2 request, 3 owner, 4 lease, 5 retention, 6 supersede revision ('' none), 7 forget.
// Reply: {0, fence, lease left, kind (0 new, 1 took over, 2 superseded, 3 same owner again)}
//        {1, fence, lease left}                                   in flight
//        {2, fence, committed at, error code, id, model, revision, result, message}   replay
//        {3, fence, 0, state}                                     conflict
inline constexpr const char* redis_lua_begin = R"lua(
local k = KEYS[1]
local lease, ret, forget = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
local r = redis.call('HMGET', k, 'q', 's', 'o', 'f', 'le', 're', 'pr')
local function claim(fence, kind)
  redis.call('DEL', k)
  redis.call('HSET', k, 'q', ARGV[2], 's', '0', 'o', ARGV[3], 'f', num(fence), 'le', num(now + lease),
             're', num(now + ret))
  keep(k, now + ret, forget)
  return {0, fence, lease, kind}
end
if not r[2] then return claim(math.max(1, now), 0) end
local state, fence, le, re = tonumber(r[2]), tonumber(r[4]), tonumber(r[5]), tonumber(r[6])
if re <= now or state == 2 then return claim(nextf(fence), 0) end
if r[1] ~= ARGV[2] then return {3, fence, 0, state} end
if state == 0 then
  if r[3] == ARGV[3] then
    local nle = math.max(le, now + lease)
    local nre = math.max(re, nle)
    redis.call('HSET', k, 'le', num(nle), 're', num(nre))
    keep(k, nre, forget)
    return {0, fence, nle - now, 3}
  end
  if now < le then return {1, fence, le - now} end
  return claim(nextf(fence), 1)
end
if ARGV[6] ~= '' and r[7] ~= ARGV[6] then return claim(nextf(fence), 2) end
local d = redis.call('HMGET', k, 'ca', 'ec', 'di', 'md', 'pr', 'r', 'em')
return {2, fence, tonumber(d[1]), tonumber(d[2]), d[3], d[4], d[5], d[6], d[7]}
)lua";

// The fenced record writes. Reply: {0} applied, {1} a repeat of a done
// write, {-1} no live record, {-2, state, fence, same owner (1/0)} not the holder.
inline constexpr const char* redis_lua_record_check = R"lua(
local k = KEYS[1]
local r = redis.call('HMGET', k, 's', 'o', 'f', 'le', 're')
if not r[1] or tonumber(r[5]) <= now then return {-1} end
local state, fence = tonumber(r[1]), tonumber(r[3])
local holder = r[2] == ARGV[2] and fence == tonumber(ARGV[3])
)lua";

// ARGV: 1 offset, 2 owner, 3 fence, 4 ttl, 5 forget.
inline constexpr const char* redis_lua_extend = R"lua(
if state ~= 0 or not holder then return {-2, state, fence, r[2] == ARGV[2] and 1 or 0} end
local nle = math.max(tonumber(r[4]), now + tonumber(ARGV[4]))
local nre = math.max(tonumber(r[5]), nle)
redis.call('HSET', k, 'le', num(nle), 're', num(nre))
keep(k, nre, tonumber(ARGV[5]))
return {0}
)lua";

// ARGV: 1 offset, 2 owner, 3 fence, 4 id, 5 model, 6 revision, 7 result, 8 error code, 9 message,
// 10 retention, 11 forget.
inline constexpr const char* redis_lua_commit = R"lua(
if state == 1 and holder then return {1} end
if state ~= 0 or not holder then return {-2, state, fence, r[2] == ARGV[2] and 1 or 0} end
local re = now + tonumber(ARGV[10])
redis.call('HSET', k, 's', '1', 'di', ARGV[4], 'md', ARGV[5], 'pr', ARGV[6], 'r', ARGV[7], 'ec', ARGV[8],
           'em', ARGV[9], 'ca', num(now), 're', num(re))
keep(k, re, tonumber(ARGV[11]))
return {0}
)lua";

// ARGV: 1 offset, 2 owner, 3 fence, 4 forget.
inline constexpr const char* redis_lua_abandon = R"lua(
if state == 2 and holder then return {1} end
if state ~= 0 or not holder then return {-2, state, fence, r[2] == ARGV[2] and 1 or 0} end
redis.call('HSET', k, 's', '2')
return {0}
)lua";

// ARGV: 1 offset, 2 owner, 3 ttl, 4 forget.
// Reply: {1, fence, left, kind (0 new, 1 took over, 3 same owner again)} acquired; {0, fence, left} held.
inline constexpr const char* redis_lua_claim = R"lua(
local k = KEYS[1]
local ttl, forget = tonumber(ARGV[3]), tonumber(ARGV[4])
local r = redis.call('HMGET', k, 'o', 'f', 'e', 'h')
if not r[2] then
  local first = math.max(1, now)
  redis.call('HSET', k, 'o', ARGV[2], 'f', num(first), 'e', num(now + ttl), 'h', '1')
  keep(k, now + ttl, forget)
  return {1, first, ttl, 0}
end
local fence, e, held = tonumber(r[2]), tonumber(r[3]), r[4] == '1'
if held and r[1] == ARGV[2] then
  local ne = math.max(e, now + ttl)
  redis.call('HSET', k, 'e', num(ne))
  keep(k, ne, forget)
  return {1, fence, ne - now, 3}
end
if held and now < e then return {0, fence, e - now} end
local nf = nextf(fence)
redis.call('HSET', k, 'o', ARGV[2], 'f', num(nf), 'e', num(now + ttl), 'h', '1')
keep(k, now + ttl, forget)
return {1, nf, ttl, held and 1 or 0}
)lua";

// Lease writes. Reply: {0} applied, {1} a repeated release, {-1} no lease,
// {-2, held (1/0), fence, same owner (1/0)} not the holder.
inline constexpr const char* redis_lua_lease_check = R"lua(
local k = KEYS[1]
local r = redis.call('HMGET', k, 'o', 'f', 'e', 'h')
if not r[2] then return {-1} end
local fence, held = tonumber(r[2]), r[4] == '1'
local holder = r[1] == ARGV[2] and fence == tonumber(ARGV[3])
)lua";

// ARGV: 1 offset, 2 owner, 3 fence, 4 ttl, 5 forget.
inline constexpr const char* redis_lua_renew = R"lua(
if not (held and holder) then return {-2, held and 1 or 0, fence, r[1] == ARGV[2] and 1 or 0} end
local ne = math.max(tonumber(r[3]), now + tonumber(ARGV[4]))
redis.call('HSET', k, 'e', num(ne))
keep(k, ne, tonumber(ARGV[5]))
return {0}
)lua";

// ARGV: 1 offset, 2 owner, 3 fence, 4 forget.
inline constexpr const char* redis_lua_release = R"lua(
if holder and not held then return {1} end
if not (held and holder) then return {-2, held and 1 or 0, fence, r[1] == ARGV[2] and 1 or 0} end
redis.call('HSET', k, 'h', '0', 'e', num(now))
keep(k, now, tonumber(ARGV[4]))
return {0}
)lua";

// ARGV: 1 offset, 2 value, 3 retention (0: until erased), 4 grace. Reply: 1 stored, 0 a live value is there.
inline constexpr const char* redis_lua_save = R"lua(
local k = KEYS[1]
local e = redis.call('HGET', k, 'e')
if e and (tonumber(e) == 0 or tonumber(e) > now) then return 0 end
local ret = tonumber(ARGV[3])
local ne = 0
if ret > 0 then ne = now + ret end
redis.call('HSET', k, 'v', ARGV[2], 'e', num(ne))
if ret > 0 then keep(k, ne, tonumber(ARGV[4])) else redis.call('PERSIST', k) end
return 1
)lua";

// ARGV: 1 offset. Reply: the value, or nil.
inline constexpr const char* redis_lua_load = R"lua(
local r = redis.call('HMGET', KEYS[1], 'v', 'e')
if not r[2] then return false end
local e = tonumber(r[2])
if e ~= 0 and e <= now then return false end
return r[1]
)lua";

}  // namespace keel::detail
