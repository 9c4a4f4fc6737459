-- Sender domains are stored and looked up in one spelling (pigeon_mta/domains.py): lower-case
-- IDNA A-labels without a final dot, as `domain add` has always written them. The signer and the
-- sender policy look a domain up by that spelling alone, so a row written some other way (by
-- hand, in SQL) would never match.
--
-- An ASCII row is brought to it here: white space and final dots go (lower case is checked since
-- 0001), unless that spelling is taken already. A row with non-ASCII labels is left as it is:
-- IDNA (RFC 5891) cannot be computed in SQL; such a row is found by `pigeon-mta domain list` and
-- replaced with `domain remove` and `domain add`, which spell the name in A-labels.
UPDATE sender_domain d SET domain = rtrim(btrim(d.domain), '.')
WHERE d.domain <> rtrim(btrim(d.domain), '.')
  AND rtrim(btrim(d.domain), '.') <> ''
  AND NOT EXISTS (SELECT 1 FROM sender_domain o WHERE o.domain = rtrim(btrim(d.domain), '.'));

-- Every row written from now on has the spelling: letters, digits, hyphens and inner dots only.
-- NOT VALID: the rows left above are not checked, but no new one can be added in another spelling.
ALTER TABLE sender_domain ADD CONSTRAINT sender_domain_spelling
    CHECK (domain ~ '^[a-z0-9-]+(\.[a-z0-9-]+)*$') NOT VALID;
