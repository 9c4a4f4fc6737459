-- How the message an attempt sent was DKIM-signed: "signed d=DOMAIN s=SELECTOR" or
-- "unsigned: REASON" (pigeon_mta/signer.py), so that `pigeon-mta log` says why mail left unsigned.
-- NULL where nothing was sent or no signer ran. Nullable with no default: adding it rewrites no rows.
ALTER TABLE attempt ADD COLUMN dkim text;
