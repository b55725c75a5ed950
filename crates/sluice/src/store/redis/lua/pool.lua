-- pool: one allocator call on a region's pool of a global window (twin of
-- algo::pool::change): the units its instance was asked for since its last call
-- counted in the region's demand, then one act: read, claim (for a ttl), fill (units the
-- global store granted), drain (unspent units, to give back) or release (the claim).
-- KEYS[1]   the window's bucket
-- ARGV      now, grace, the policy (as apply's), the window's field, the window's end,
--           arrived, the act (read, claim, fill, drain, release), its units (a claim:
--           its ttl), the demand's bucket in ms, what the global store said was left
--           (one more; 0: nothing said)
-- Reply     units moved (a claim: 1 if taken), cap, used, claim_until, demand_at,
--           before, this, left (one more; 0: not said in this window)
local now, grace = int(ARGV[1]), int(ARGV[2])
local p = policy(ARGV[3])
local kind, p2 = p[1], p[3]
local key, field, e, arrived = KEYS[1], ARGV[4], int(ARGV[5]), int(ARGV[6])
local act, units, bucket, said = ARGV[7], int(ARGV[8]), int(ARGV[9]), int(ARGV[10])
local lx, ly = load(kind, key, field, p2, now)
local used = 0
if ly == e then used = lx end
local cap, claim, at, before, this, left = pool_load(key, field, e)
if said > 0 then left = said end
-- Demand::report
local since = max(now - at, 0)
if since >= 2 * bucket then
  at, before, this = now, 0, 0
elseif since >= bucket then
  at, before, this = now, this, 0
end
this = this + arrived
local moved = 0
if act == 'claim' then
  if now >= claim then moved, claim = 1, now + units end
elseif act == 'fill' then
  moved, cap, claim = units, cap + units, 0
elseif act == 'drain' then
  moved = min(units, max(cap - used, 0))
  cap, claim = cap - moved, 0
elseif act == 'release' then
  claim = 0
end
pool_store(key, field, e, cap, claim, at, before, this, left, grace)
return {moved, cap, used, claim, at, before, this, left}
