-- commit: settles reservation `id` on each state with its actual amount (twin of
-- algo::reservation::commit): an open hold's units are replaced by the actual; a
-- reservation not open (released at its deadline, of another window, unknown) is
-- charged its actual as a report, never refused; one committed already changes nothing.
-- Id 0 (reservation::REPORT) is a report of no reservation, remembered nowhere.
-- KEYS[i]   commit i's bucket
-- ARGV      now, grace (as apply's), the reservation's id (decimal), then 3 values per
--           commit: its policy (as apply's), the actual amount, its state's field
-- Reply     2 integers per commit: what it did (0 committed, 1 reported, 2 again) and
--           the units the hold had
local now, grace, id = int(ARGV[1]), int(ARGV[2]), ARGV[3]
local reply = {}
for i = 1, #KEYS do
  local p, actual, field = policy(ARGV[1 + 3 * i]), int(ARGV[2 + 3 * i]), ARGV[3 + 3 * i]
  local s = reserved_load(KEYS[i], field, p, now)
  local did, held = nil, 0
  if id == '0' then
    -- reservation::REPORT: charged, never refused, nothing remembered
    s.u, did = s.u + actual, 1
  end
  for j = 1, #s.settled, 3 do
    if s.settled[j] == id and s.settled[j + 1] == 'c' then did = 2 end
  end
  if did == nil then
    local at = nil
    for j = #s.open - 2, 1, -3 do
      if s.open[j] == id then at = j end
    end
    if at ~= nil then
      local e = s.open[at + 2]
      held = s.open[at + 1]
      for _ = 1, 3 do table.remove(s.open, at) end
      s.u, did = max(s.u - held, 0) + actual, 0
      ledger_settle(s.settled, id, 'c', max(max(e, s.r), now))
      s.h = nil
      for j = 3, #s.open, 3 do
        if s.h == nil or s.open[j] < s.h then s.h = s.open[j] end
      end
    else
      s.u, did = s.u + actual, 1
      ledger_settle(s.settled, id, 'c', max(s.r, now))
    end
  end
  reserved_store(s, KEYS[i], field, p, now, grace)
  reply[2 * i - 1], reply[2 * i] = did, held
end
return reply
