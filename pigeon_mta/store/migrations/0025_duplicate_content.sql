-- A message is a duplicate of one queued under the same Message-ID within the duplicate window
-- only if its content is the same too: an application that reuses a Message-ID for another
-- message (a template's fixed ID, a counter reset) must not have it dropped. `content_key` is
-- BLAKE2b-128 of the client's bytes (store/duplicates.py); entries written before it have none
-- and still match on the Message-ID alone.
ALTER TABLE submission_dedup ADD COLUMN content_key bytea;
-- The message queued earlier under the same Message-ID with other content, within the window:
-- `pigeon-mta log` says this one was queued anyway, and why.
ALTER TABLE message ADD COLUMN reuses uuid;
