-- foreign_report: reconcile's report of the pods with our labels that are not provably ours
-- (pod identity), replaced as a whole after each pass: readers (the admin view, /metrics on
-- any replica) never see half of one.
--
-- KEYS[1] resource:foreign_pods:{foreign}        HASH   "{namespace}/{pod}" -> JSON of the pod
-- KEYS[2] resource:foreign_pods:{foreign}:count  STRING foreign pods the last pass saw (the
--         hash holds at most a bounded number of them); both under the literal tag {foreign}
-- ARGV[1] that count   ARGV[2 ..] field, value, field, value ... (a bounded number)
--
-- returns the count
--
-- invariant: only ever the last pass's report; replay-safe (same content again).
redis.call('DEL', KEYS[1])
if #ARGV > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end
redis.call('SET', KEYS[2], ARGV[1])
return tonumber(ARGV[1])
