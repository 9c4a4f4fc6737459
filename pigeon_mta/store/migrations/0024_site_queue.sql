-- Site queues: mail waiting for a destination's rate budget is left alone until the budget has
-- room for it, and that room is shared fairly between the lanes and orgs waiting for it.
--
-- A recipient whose delivery found no token of its destination's budget is handed back with
-- `site` set to that budget's key (store/leases.py, postpone_leases) and is not touched again
-- until the claim's `site_pick` below takes it: no booked due time, no claim-and-hand-back round
-- every minute. An attempt's record clears it (store/outcomes.py). The general claim takes only
-- rows without a site.
-- (IF NOT EXISTS: an operator who builds the indexes below beforehand adds it first; it takes no
-- table rewrite.)
ALTER TABLE recipient ADD COLUMN IF NOT EXISTS site text;

-- The general claim's index (migration 0017) holds only rows without a site, so that a site's
-- waiting backlog costs its skip scan nothing.
-- IF NOT EXISTS (here and below): on a large queue an operator may build these beforehand with
-- CREATE INDEX CONCURRENTLY, under these names and definitions (deploy/README.md, "Upgrades and
-- large queues"); built here, each blocks writes to recipient while it is built.
CREATE INDEX IF NOT EXISTS recipient_due_general ON recipient (org_id, lane, next_attempt_at)
    WHERE status = 'queued' AND site IS NULL;
DROP INDEX recipient_due_group;
ALTER INDEX recipient_due_general RENAME TO recipient_due_group;

-- The site queues: per site, the (org, lane) groups waiting, each oldest first.
CREATE INDEX IF NOT EXISTS recipient_site_due ON recipient (site, org_id, lane, next_attempt_at)
    WHERE status = 'queued' AND site IS NOT NULL;

-- The retry queue: a deferred recipient waits for its next attempt with site 'later'
-- (store/outcomes.py), so that the general claim's skip scan does not visit every group with
-- deferred mail (20,000 tenants with a deferred recipient each made every claim take 68 ms); the
-- claim wakes the due ones, oldest first, through this index (store/leases.py).
CREATE INDEX IF NOT EXISTS recipient_later ON recipient (next_attempt_at)
    WHERE status = 'queued' AND site = 'later';

-- Dead sites (store/budgets.py, report_connections): failed connections in a row, cluster-wide,
-- and while parked, when its next probe is due and why it was parked. A parked site's mail waits
-- in its queue; site_pick claims one probe delivery when parked_until has passed.
ALTER TABLE budget ADD COLUMN failures integer NOT NULL DEFAULT 0;
ALTER TABLE budget ADD COLUMN parked_until timestamptz;
ALTER TABLE budget ADD COLUMN parked_reason text;
-- How long the current parking lasts (doubled by each failed probe), and whether its probe is out.
ALTER TABLE budget ADD COLUMN park_seconds double precision NOT NULL DEFAULT 0;
ALTER TABLE budget ADD COLUMN probing boolean NOT NULL DEFAULT false;

-- A destination without configured limits that backed off recovers to what it was sending when
-- it was throttled, and stays capped there (effective_rate, effective_concurrency), not at
-- "unlimited": the server told us where its limit is, and going past it again made a 421
-- sawtooth. Configuring the destination ends the cap.
ALTER TABLE budget ADD COLUMN capped boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION budget_recover(p_keys text[], p_step double precision,
                                          p_quiet double precision)
RETURNS void LANGUAGE sql AS $$
WITH due AS (
    SELECT b.key,
           floor(extract(epoch FROM now() - greatest(b.changed_at, b.throttled_at)) / p_quiet)
               AS periods,
           b.rate > 0 OR b.concurrency > 0 AS configured,
           CASE WHEN b.rate > 0 THEN b.rate ELSE b.recover_rate END AS to_rate,
           CASE WHEN b.concurrency > 0 THEN b.concurrency ELSE b.recover_concurrency END AS to_conc
    FROM budget b
    WHERE b.backoff AND (p_keys IS NULL OR b.key = ANY (p_keys))
      AND greatest(b.changed_at, b.throttled_at) <= now() - make_interval(secs => p_quiet)
    FOR UPDATE SKIP LOCKED
), stepped AS (
    SELECT due.key, due.periods, due.configured,
           least(due.to_rate, b.effective_rate + due.periods * p_step * due.to_rate) AS new_rate,
           least(due.to_conc, b.effective_concurrency
                 + greatest(1, ceil(due.periods * p_step * due.to_conc))::integer) AS new_conc,
           due.to_rate, due.to_conc
    FROM due JOIN budget b USING (key)
)
UPDATE budget b
SET backoff = NOT (s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc),
    capped = NOT s.configured AND s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc,
    effective_rate = CASE WHEN s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc
                          THEN CASE WHEN s.configured THEN b.rate ELSE s.to_rate END
                          ELSE s.new_rate END,
    effective_concurrency = CASE WHEN s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc
                                 THEN CASE WHEN s.configured THEN b.concurrency ELSE s.to_conc END
                                 ELSE s.new_conc END,
    changed_at = greatest(b.changed_at, b.throttled_at)
                 + make_interval(secs => s.periods * p_quiet),
    updated_at = now()
FROM stepped s WHERE b.key = s.key
$$;

-- A budget's tokens may now be below zero: the site claim takes the tokens of the next
-- p_ahead seconds and the rows it claims wait for them in the engine (a token apart). The
-- earlier budget_take forgave such a debt at its next refill; this one keeps it, and never
-- grants less than nothing. In backoff the bucket holds one token, not a second's worth: after a
-- stall a throttling destination got twice its rate within a second. While the site is parked it
-- grants no tokens (a delivery then waits in
-- the site's queue) and says until when. Otherwise unchanged from migration 0023.
DROP FUNCTION budget_take(text[], double precision[], integer[], double precision[], integer[],
                          integer[], text, double precision, double precision, double precision,
                          double precision, double precision);
CREATE FUNCTION budget_take(
    p_keys text[], p_rates double precision[], p_concs integer[], p_bursts double precision[],
    p_tokens integer[], p_slots integer[], p_holder text, p_lease double precision,
    p_horizon double precision, p_step double precision, p_quiet double precision,
    p_stale double precision DEFAULT 30
) RETURNS TABLE (key text, tokens integer, slots integer, held integer,
                 booked_from timestamptz, effective_rate double precision,
                 effective_concurrency integer, held_until timestamptz,
                 parked_until timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v record;
    b budget;
    burst double precision;
    granted integer;
    granted_slots integer;
    mine integer;
    others integer;
    wait double precision;
    booked timestamptz;
    on_hold boolean;
    t timestamptz;  -- this budget's time: read once its row is locked
BEGIN
    PERFORM budget_recover(p_keys, p_step, p_quiet);
    FOR v IN SELECT * FROM unnest(p_keys, p_rates, p_concs, p_bursts, p_tokens, p_slots)
             AS u (key, rate, conc, burst, want, want_slots) ORDER BY 1
    LOOP
        INSERT INTO budget AS u (key, rate, concurrency, burst, effective_rate,
                                 effective_concurrency, tokens)
        VALUES (v.key, v.rate, v.conc, v.burst, v.rate, v.conc, v.burst)
        ON CONFLICT ON CONSTRAINT budget_pkey DO NOTHING;
        SELECT * INTO b FROM budget u WHERE u.key = v.key FOR UPDATE;
        t := greatest(clock_timestamp(), b.refilled_at);
        IF b.backoff THEN
            IF v.rate > 0 THEN b.effective_rate := least(b.effective_rate, v.rate); END IF;
            IF v.conc > 0 THEN
                b.effective_concurrency := least(b.effective_concurrency, v.conc);
            END IF;
        ELSIF b.capped AND v.rate <= 0 AND v.conc <= 0 THEN
            NULL;  -- capped at what it took before its backoff (budget_recover)
        ELSE
            b.effective_rate := v.rate;
            b.effective_concurrency := v.conc;
            b.capped := false;
        END IF;
        on_hold := b.held_until IS NOT NULL AND b.held_until > t;
        granted := v.want;
        booked := t;
        IF b.parked_until IS NOT NULL THEN
            granted := 0;
            booked := greatest(t, b.parked_until);
        ELSIF b.effective_rate > 0 THEN
            -- In backoff one token: after a stall the destination gets no burst at all.
            burst := CASE WHEN b.backoff THEN 1 ELSE greatest(1, v.burst) END;
            b.tokens := least(burst, b.tokens
                + extract(epoch FROM t - b.refilled_at) * b.effective_rate);
            granted := CASE WHEN on_hold THEN 0
                            ELSE greatest(0, least(v.want, floor(b.tokens)::integer)) END;
            b.tokens := b.tokens - granted;
            IF granted < v.want THEN
                wait := greatest(0, 1 - b.tokens) / b.effective_rate;
                booked := greatest(t + make_interval(secs => wait),
                                   least(b.booked_until, t + make_interval(secs => p_horizon)));
                IF on_hold THEN booked := greatest(booked, b.held_until); END IF;
                b.booked_until := booked
                    + make_interval(secs => (v.want - granted) / b.effective_rate);
            END IF;
        ELSIF on_hold THEN
            granted := 0;
            booked := b.held_until;
        END IF;
        granted_slots := v.want_slots;
        mine := 0;
        IF b.effective_concurrency > 0 THEN
            DELETE FROM budget_slot s
            WHERE s.key = v.key
              AND (s.lease_until < t
                   OR EXISTS (
                       SELECT 1 FROM node n
                       WHERE starts_with(s.holder, n.name || '/')
                         AND NOT (split_part(substr(s.holder, length(n.name) + 2), '#', 1)
                                      = n.run_id
                                  AND n.stopped_at IS NULL
                                  AND n.heartbeat_at >= t - make_interval(secs => p_stale))));
            SELECT coalesce(sum(s.slots) FILTER (WHERE s.holder <> p_holder), 0),
                   coalesce(sum(s.slots) FILTER (WHERE s.holder = p_holder), 0)
            INTO others, mine FROM budget_slot s WHERE s.key = v.key;
            granted_slots := CASE WHEN on_hold THEN 0 ELSE
                greatest(0, least(v.want_slots, b.effective_concurrency - others - mine)) END;
            IF granted_slots > 0 OR mine > 0 THEN
                INSERT INTO budget_slot AS s (key, holder, slots, lease_until)
                VALUES (v.key, p_holder, mine + granted_slots,
                        t + make_interval(secs => p_lease))
                ON CONFLICT ON CONSTRAINT budget_slot_pkey DO UPDATE
                SET slots = excluded.slots, lease_until = excluded.lease_until;
            END IF;
        END IF;
        UPDATE budget u
        SET rate = v.rate, concurrency = v.conc, burst = v.burst,
            effective_rate = b.effective_rate, effective_concurrency = b.effective_concurrency,
            capped = b.capped, tokens = b.tokens, refilled_at = t, booked_until = b.booked_until,
            updated_at = t
        WHERE u.key = v.key;
        key := v.key;
        tokens := granted;
        slots := granted_slots;
        held := mine + granted_slots;
        booked_from := booked;
        effective_rate := b.effective_rate;
        effective_concurrency := b.effective_concurrency;
        held_until := b.held_until;
        parked_until := b.parked_until;
        RETURN NEXT;
    END LOOP;
END
$$;

-- Operator suspensions (`pigeon-mta queue suspend|resume`, store/suspensions.py): mail of a
-- suspended org or lane is not claimed; mail to a suspended site or domain waits in a queue of
-- that key (recipient.site: the site's budget key, or 'domain:NAME'), not claimed either. A
-- suspension ends at `until` (NULL: when resumed).
CREATE TABLE suspension (
    -- 'org:UUID', 'lane:NAME', 'domain:NAME' or a destination budget key ('destination:...')
    key         text PRIMARY KEY,
    until       timestamptz,
    reason      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Whether an (org, lane) group's mail is suspended now (both claims ask, per group).
CREATE FUNCTION suspended(p_org uuid, p_lane text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM suspension x
        WHERE x.key IN ('org:' || p_org, 'lane:' || p_lane)
          AND (x.until IS NULL OR x.until > now()))
$$;

-- The site claim, one part of the claim statement (store/leases.py). It walks the sites with
-- waiting rows (a skip scan of recipient_site_due, in random order), and for each site whose
-- budget row it can lock at once (SKIP LOCKED: another engine is taking from it) it claims what
-- the budget has room for: its tokens now and those of the next p_ahead seconds, at most p_limit
-- rows in all. Within a site the room is shared as the general claim shares a batch: each lane
-- by its weight (p_lanes, p_weights; a lane not named weighs 1), a lane's share evenly between
-- its orgs (random ones when there are more orgs than places), what a group leaves unused to the
-- others in random order. The tokens are taken here, in the same transaction.
--
-- Each row comes with `delay`, the seconds until its token is there (a token apart, the groups
-- interleaved by their shares), which the engine waits before it sends. A row without an id says
-- when the claim should come back for a site it could not serve (its room used up, its budget on
-- hold or locked). A site whose budget has no rate any more (or no row) gives its rows back to the
-- general claim. A parked site gives nothing until its parked_until, then one row, its probe, and
-- its next probe is due p_probe seconds later unless the probe's connection decides first.
CREATE FUNCTION site_pick(p_limit integer, p_lanes text[], p_weights double precision[],
                          p_ahead double precision, p_probe double precision DEFAULT 60)
RETURNS TABLE (id uuid, delay double precision)
-- Its skip scans are cheap, but the planner prices a recursive walk high: past jit_above_cost,
-- each call spent 6 ms compiling it (the whole claim takes 2-3) on a connection with JIT on (the
-- service's own connections have it off, store/connect.py).
LANGUAGE plpgsql SET jit = off AS $$
#variable_conflict use_column
DECLARE
    s record;
    b budget;
    t timestamptz;
    have double precision;
    burst double precision;
    room integer;
    left_over integer := p_limit;
    picked uuid[];
    n integer;
    tokens_taken integer;
BEGIN
    FOR s IN
        WITH RECURSIVE sites AS (
            (SELECT r.site FROM recipient r WHERE r.status = 'queued' AND r.site IS NOT NULL
             ORDER BY r.site LIMIT 1)
            UNION ALL
            SELECT x.site FROM sites w CROSS JOIN LATERAL (
                SELECT r.site FROM recipient r
                WHERE r.status = 'queued' AND r.site IS NOT NULL AND r.site > w.site
                ORDER BY r.site LIMIT 1) x
        )
        SELECT sites.site FROM sites ORDER BY random()
    LOOP
        CONTINUE WHEN s.site = 'later';  -- the retry queue: the claim wakes it (store/leases.py)
        IF left_over <= 0 THEN
            id := NULL; delay := 0; RETURN NEXT;  -- more sites wait: claim again at once
            EXIT;
        END IF;
        SELECT x.until INTO t FROM suspension x
        WHERE x.key = s.site AND (x.until IS NULL OR x.until > now());
        IF FOUND THEN
            -- Suspended by an operator: nothing is claimed; back when it ends (or in a second,
            -- for a resume).
            id := NULL;
            delay := least(1, coalesce(extract(epoch FROM t - now()), 1));
            RETURN NEXT;
            CONTINUE;
        END IF;
        SELECT * INTO b FROM budget u WHERE u.key = s.site FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            IF EXISTS (SELECT 1 FROM budget u WHERE u.key = s.site) THEN
                id := NULL; delay := 0.05; RETURN NEXT;  -- another engine holds it this moment
            ELSE
                UPDATE recipient r SET site = NULL, updated_at = now()
                WHERE r.id = ANY (ARRAY (
                    SELECT q.id FROM recipient q WHERE q.status = 'queued' AND q.site = s.site
                    FOR UPDATE SKIP LOCKED));
            END IF;
            CONTINUE;
        END IF;
        t := greatest(clock_timestamp(), b.refilled_at);
        IF b.parked_until IS NOT NULL THEN
            IF b.parked_until > t THEN
                id := NULL; delay := extract(epoch FROM b.parked_until - t); RETURN NEXT;
                CONTINUE;
            END IF;
            -- The probe: the oldest due row of the site, and no other until it has told.
            RETURN QUERY
                SELECT x.id, 0::float8 FROM (
                    SELECT r.id FROM recipient r
                    WHERE r.status = 'queued' AND r.site = s.site AND r.next_attempt_at <= t
                      AND NOT suspended(r.org_id, r.lane)
                    ORDER BY r.site, r.org_id, r.lane, r.next_attempt_at LIMIT 1
                    FOR UPDATE SKIP LOCKED) x;
            IF FOUND THEN
                UPDATE budget u SET parked_until = t + make_interval(secs => p_probe),
                                    probing = true, updated_at = t
                WHERE u.key = s.site;
                left_over := left_over - 1;
            END IF;
            CONTINUE;
        END IF;
        -- A stated retry delay holds the queue, with or without a rate (a budget of sessions
        -- only, or one whose backoff ended, holds it as long).
        IF b.held_until IS NOT NULL AND b.held_until > t THEN
            id := NULL; delay := extract(epoch FROM b.held_until - t); RETURN NEXT;
            CONTINUE;
        END IF;
        IF b.effective_rate <= 0 THEN
            UPDATE recipient r SET site = NULL, updated_at = now()
            WHERE r.id = ANY (ARRAY (
                SELECT q.id FROM recipient q WHERE q.status = 'queued' AND q.site = s.site
                FOR UPDATE SKIP LOCKED));
            CONTINUE;
        END IF;
        burst := CASE WHEN b.backoff THEN 1 ELSE greatest(1, b.burst) END;
        have := least(burst, b.tokens + extract(epoch FROM t - b.refilled_at) * b.effective_rate);
        room := least(left_over, floor(have + p_ahead * b.effective_rate)::integer);
        IF room <= 0 THEN
            id := NULL;
            delay := (1 - have - p_ahead * b.effective_rate) / b.effective_rate;
            RETURN NEXT;
            CONTINUE;
        END IF;
        picked := ARRAY (
            WITH RECURSIVE groups AS (
                (SELECT r.org_id, r.lane, r.next_attempt_at AS oldest FROM recipient r
                 WHERE r.status = 'queued' AND r.site = s.site
                 ORDER BY r.site, r.org_id, r.lane, r.next_attempt_at LIMIT 1)
                UNION ALL
                SELECT x.* FROM groups g CROSS JOIN LATERAL (
                    SELECT r.org_id, r.lane, r.next_attempt_at FROM recipient r
                    WHERE r.status = 'queued' AND r.site = s.site
                      AND (r.site, r.org_id, r.lane) > (s.site, g.org_id, g.lane)
                    ORDER BY r.site, r.org_id, r.lane, r.next_attempt_at LIMIT 1) x
            ), due AS (
                SELECT g.org_id, g.lane, COALESCE(w.weight, 1.0) AS weight,
                       count(*) OVER (PARTITION BY g.lane) AS orgs,
                       row_number() OVER (PARTITION BY g.lane ORDER BY random()) AS pick
                FROM groups g
                LEFT JOIN unnest(p_lanes, p_weights) AS w (lane, weight) ON w.lane = g.lane
                WHERE g.oldest <= t AND NOT suspended(g.org_id, g.lane)
            ), lanes AS (
                SELECT l.lane, greatest(1, floor(room * l.weight / sum(l.weight) OVER ()))::int
                           AS share
                FROM (SELECT DISTINCT d.lane, d.weight FROM due d) l
            ), shares AS (
                SELECT d.org_id, d.lane, random() AS turn,
                       (l.share / d.orgs
                        + CASE WHEN d.pick <= l.share % d.orgs THEN 1 ELSE 0 END)::int AS share
                FROM due d JOIN lanes l USING (lane)
            ), fair AS (
                SELECT x.id, x.next_attempt_at, sh.org_id, sh.lane, sh.turn, sh.share
                FROM (SELECT * FROM shares WHERE share > 0 ORDER BY turn) sh
                CROSS JOIN LATERAL (
                    SELECT r.id, r.next_attempt_at FROM recipient r
                    WHERE r.status = 'queued' AND r.site = s.site AND r.org_id = sh.org_id
                      AND r.lane = sh.lane AND r.next_attempt_at <= t
                    ORDER BY r.next_attempt_at LIMIT sh.share
                    FOR UPDATE SKIP LOCKED) x
                LIMIT room
            ), rest AS (
                SELECT x.id, x.next_attempt_at, sh.org_id, sh.lane, sh.turn, sh.share
                FROM (SELECT * FROM shares ORDER BY turn) sh
                CROSS JOIN LATERAL (
                    SELECT r.id, r.next_attempt_at FROM recipient r
                    WHERE r.status = 'queued' AND r.site = s.site AND r.org_id = sh.org_id
                      AND r.lane = sh.lane AND r.next_attempt_at <= t
                      AND r.id <> ALL (ARRAY (SELECT f.id FROM fair f))
                    ORDER BY r.next_attempt_at LIMIT room
                    FOR UPDATE SKIP LOCKED) x
                LIMIT greatest(0, room - (SELECT count(*) FROM fair))
            )
            -- Interleaved by share: a group's k-th row goes at k / share, so the delays of
            -- each group are spread over the room in proportion to its share.
            SELECT a.id FROM (
                SELECT u.id, u.turn,
                       row_number() OVER (PARTITION BY u.org_id, u.lane
                                          ORDER BY u.next_attempt_at)::float8
                           / greatest(1, u.share) AS finish
                FROM (SELECT * FROM fair UNION ALL SELECT * FROM rest) u) a
            ORDER BY a.finish, a.turn);
        n := cardinality(picked);
        IF n = 0 THEN
            CONTINUE;
        END IF;
        -- A token is a message: the other recipients of the messages picked that wait in this
        -- queue come along (one transaction, one token); each message's rows share the delay
        -- of its token, in the order the messages were picked.
        picked := picked || ARRAY (
            SELECT q.id FROM recipient q
            WHERE q.message_id = ANY (ARRAY (
                      SELECT r.message_id FROM recipient r WHERE r.id = ANY (picked)))
              AND q.status = 'queued' AND q.site = s.site AND q.id <> ALL (picked)
            FOR UPDATE SKIP LOCKED);
        SELECT count(DISTINCT r.message_id)::integer INTO tokens_taken
        FROM recipient r WHERE r.id = ANY (picked);
        UPDATE budget u SET tokens = have - tokens_taken, refilled_at = t, updated_at = t
        WHERE u.key = s.site;
        left_over := left_over - cardinality(picked);
        RETURN QUERY
            WITH p AS (
                SELECT u.id, u.i, r.message_id
                FROM unnest(picked) WITH ORDINALITY AS u (id, i) JOIN recipient r ON r.id = u.id
            ), k AS (
                SELECT p.message_id, rank() OVER (ORDER BY min(p.i)) AS k
                FROM p GROUP BY p.message_id
            )
            SELECT p.id, greatest(0, (k.k - have) / b.effective_rate)::float8
            FROM p JOIN k USING (message_id);
        IF n >= room AND room < left_over + cardinality(picked) THEN
            -- The budget's room is used up and more may wait: come back as it refills.
            id := NULL; delay := greatest(0.05, p_ahead / 2); RETURN NEXT;
        END IF;
    END LOOP;
END
$$;

-- What engines must ask for beyond their configuration (migration 0018), and now also the sites
-- that are parked ('parked', key, 0): an engine routes their mail into the site's queue.
DROP FUNCTION budget_in_force(double precision, double precision);
CREATE FUNCTION budget_in_force(p_step double precision, p_quiet double precision)
RETURNS TABLE (kind text, key text, rate double precision, note text)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM budget_recover(NULL, p_step, p_quiet);
    RETURN QUERY
        SELECT 'org'::text, o.id::text, o.rate, NULL::text FROM org o WHERE o.rate > 0
        UNION ALL
        SELECT 'backoff'::text, b.key, b.effective_rate, NULL FROM budget b WHERE b.backoff
        UNION ALL
        SELECT 'parked'::text, b.key, 0::float8, NULL FROM budget b
        WHERE b.parked_until IS NOT NULL
        UNION ALL
        SELECT 'capped'::text, b.key, b.effective_rate, NULL FROM budget b WHERE b.capped
        UNION ALL
        -- Operator suspensions in force: the engines hand such mail back unattempted.
        -- (the note as store/suspensions.py's NOTE words it)
        SELECT 'suspended'::text, x.key, 0::float8,
               'suspended by an operator: ' || x.reason
               || CASE WHEN x.until IS NULL THEN ' (until resumed)'
                       ELSE ' (until ' || to_char(x.until AT TIME ZONE 'UTC',
                                                  'YYYY-MM-DD HH24:MI:SS') || ' UTC)' END
               || '; not attempted meanwhile'
        FROM suspension x WHERE x.until IS NULL OR x.until > now();
END
$$;
CREATE INDEX budget_parked ON budget (key) WHERE parked_until IS NOT NULL;
