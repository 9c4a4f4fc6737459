-- A tenant's reputation: sent mail, hard bounces and complaints per org, lane and hour, counted as they
-- are recorded (store/reputation.py), and the pauses it leads to.

-- Attempts are appended in the order they are recorded: a block-range index finds the newest at
-- almost no cost to the record statement (it is summarised lazily).
CREATE INDEX attempt_recorded_brin ON attempt USING brin (recorded_at);

CREATE TABLE reputation_count (
    org_id      uuid NOT NULL REFERENCES org (id) ON DELETE CASCADE,
    lane        text NOT NULL,
    hour        timestamptz NOT NULL,
    sent        bigint NOT NULL DEFAULT 0,  -- recipients delivered or bounced
    bounced     bigint NOT NULL DEFAULT 0,  -- hard bounces, at once or reported later
    complained  bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (org_id, lane, hour)
);

-- Up to when attempts and feedback events are counted: one row, advanced by the node that counts
-- (the row's lock keeps two nodes from counting the same range).
CREATE TABLE reputation_mark (
    only_row    boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    counted_to  timestamptz NOT NULL
);
INSERT INTO reputation_mark (counted_to) VALUES (now());

-- When an operator last resumed the org: a pause by reputation is not made again before the
-- window has passed since (the rates that paused it would pause it again at once).
ALTER TABLE org ADD COLUMN resumed_at timestamptz;

-- A pause by reputation is a suspension of the org of kind 'reputation'.
CREATE OR REPLACE FUNCTION suspension_note(x suspension) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN x.kind = 'operator' THEN 'suspended by an operator: '
                WHEN x.kind = 'reputation' THEN 'org paused: '
                WHEN x.key LIKE '%|org:%' THEN 'held for its org: '
                ELSE 'suspended after a reply: ' END
           || x.reason
           || CASE WHEN x.until IS NULL THEN ' (until resumed)'
                   ELSE ' (until ' || to_char(x.until AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
                        || ' UTC)' END
           || '; not attempted meanwhile'
$$;
