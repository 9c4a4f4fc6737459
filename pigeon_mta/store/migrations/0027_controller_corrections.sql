-- Corrections to the site controller of migration 0026, and the org's room in the site claim.
--
-- 1. A decrease's hold is counted from the decrease (`decreased_at`), not from `changed_at`,
--    which recovery steps and reply-rule limits also write: a throttling reply just after a
--    recovery step or a limit started a new decrease, not an addition to a stale one (which
--    computed from the old decrease's rates and could raise the rate a rule had just lowered).
--    While a rule's limit is in force a throttling reply never raises the effective rate or
--    sessions.
-- 2. A decrease while a rule's limit is in force does not make the limit the site's recovery
--    target (the site would stay capped at the rule's value for good): the target stays where
--    it was (none for a site that never throttled us, which then ends unlimited). The capped
--    probe raises the target with the rate it probes.
-- 3. suspension_note reads the time zone (to_char): STABLE, not IMMUTABLE.
-- 4. site_pick takes the engine's room per org (p_orgs, p_rooms; p_room for an org not named,
--    NULL for no cap), as the general claim does (store/leases.py, delivery.max_org_share): an org
--    without room is passed over at every site, and what it picks at one site is off its room at
--    the next. Each row names its org, so that the general claim takes what is left of the room.
-- 5. The controller moves into the engines (pigeon_mta/site_control.py, pure; store/controls.py
--    drives it under the row lock). This release's engines pass budget_take and budget_in_force a
--    quiet period of 0, which recovers nothing here; budget_throttled, budget_limit and the
--    recovery stay for nodes of the release before, which keep calling them during a rolling
--    upgrade (the same arithmetic: a budget one of them recovered is not due for the other).

ALTER TABLE budget ADD COLUMN decreased_at timestamptz;
UPDATE budget SET decreased_at = throttled_at WHERE backoff;

-- As in migration 0026, with 1 and 2 above.
CREATE OR REPLACE FUNCTION budget_throttled(
    p_keys text[], p_holders text[], p_rates double precision[], p_concs integer[],
    p_replies text[], p_factor double precision, p_hold double precision
) RETURNS void LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v record;
    b budget;
    t timestamptz;
    from_rate double precision;
    from_conc integer;
    limited boolean;
BEGIN
    FOR v IN SELECT * FROM unnest(p_keys, p_holders, p_rates, p_concs, p_replies)
             AS u (key, holder, rate, conc, reply) ORDER BY 1
    LOOP
        INSERT INTO budget AS u (key, tokens) VALUES (v.key, 0)
        ON CONFLICT ON CONSTRAINT budget_pkey DO NOTHING;
        SELECT * INTO b FROM budget u WHERE u.key = v.key FOR UPDATE;
        t := clock_timestamp();
        limited := coalesce(b.limited_until > t, false);
        -- (coalesce: a backoff a rule's limit began has no decrease, and NOT NULL is NULL)
        IF NOT coalesce(b.backoff AND b.decreased_at > t - make_interval(secs => p_hold),
                        false) THEN
            -- A new decrease: from the rate in force, or (none) from the reports.
            b.base_rate := greatest(0, b.effective_rate);
            b.base_concurrency := greatest(0, b.effective_concurrency);
            b.reporters := ARRAY[v.holder];
            b.reported_rate := greatest(1, v.rate);
            b.reported_concurrency := greatest(1, v.conc);
            b.tokens := least(b.tokens, 0);
            b.changed_at := t;
            b.decreased_at := t;
        ELSIF v.holder <> ALL (b.reporters) THEN
            b.reporters := b.reporters || v.holder;
            b.reported_rate := b.reported_rate + greatest(1, v.rate);
            b.reported_concurrency := b.reported_concurrency + greatest(1, v.conc);
        END IF;
        from_rate := CASE WHEN b.base_rate > 0 THEN b.base_rate ELSE b.reported_rate END;
        from_conc := CASE WHEN b.base_concurrency > 0 THEN b.base_concurrency
                          ELSE b.reported_concurrency END;
        UPDATE budget u
        SET effective_rate = CASE WHEN limited AND b.effective_rate > 0
                                  THEN least(b.effective_rate, greatest(1, from_rate * p_factor))
                                  ELSE greatest(1, from_rate * p_factor) END,
            effective_concurrency = CASE
                WHEN limited AND b.effective_concurrency > 0
                THEN least(b.effective_concurrency,
                           greatest(1, floor(from_conc * p_factor))::integer)
                ELSE greatest(1, floor(from_conc * p_factor))::integer END,
            recover_rate = CASE WHEN NOT limited THEN from_rate
                                WHEN b.recover_rate > 0 THEN greatest(b.recover_rate, from_rate)
                                ELSE 0 END,
            recover_concurrency = CASE
                WHEN NOT limited THEN from_conc
                WHEN b.recover_concurrency > 0 THEN greatest(b.recover_concurrency, from_conc)
                ELSE 0 END,
            base_rate = b.base_rate, base_concurrency = b.base_concurrency,
            reporters = b.reporters, reported_rate = b.reported_rate,
            reported_concurrency = b.reported_concurrency,
            tokens = b.tokens, changed_at = b.changed_at, decreased_at = b.decreased_at,
            backoff = true, capped = false, throttled_at = t, last_reply = v.reply,
            updated_at = t
        WHERE u.key = v.key;
    END LOOP;
END
$$;

-- As in migration 0026; the capped probe raises the recovery target with the rate (2 above),
-- and a quiet period of 0 recovers nothing (5 below).
CREATE OR REPLACE FUNCTION budget_recover(p_keys text[], p_step double precision,
                                          p_quiet double precision)
RETURNS void LANGUAGE sql AS $$
WITH due AS (
    SELECT b.key,
           floor(extract(epoch FROM now() - greatest(b.changed_at, b.throttled_at,
                                                    b.limited_until)) / p_quiet) AS periods,
           b.rate > 0 OR b.concurrency > 0 AS configured,
           CASE WHEN b.rate > 0 THEN b.rate ELSE b.recover_rate END AS to_rate,
           CASE WHEN b.concurrency > 0 THEN b.concurrency ELSE b.recover_concurrency END AS to_conc
    FROM budget b
    WHERE b.backoff AND p_quiet > 0 AND (p_keys IS NULL OR b.key = ANY (p_keys))
      AND greatest(b.changed_at, b.throttled_at, b.limited_until)
          <= now() - make_interval(secs => p_quiet)
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
    capped = NOT s.configured AND s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc
             AND (s.to_rate > 0 OR s.to_conc > 0),
    effective_rate = CASE WHEN s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc
                          THEN CASE WHEN s.configured THEN b.rate ELSE s.to_rate END
                          ELSE s.new_rate END,
    effective_concurrency = CASE WHEN s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc
                                 THEN CASE WHEN s.configured THEN b.concurrency ELSE s.to_conc END
                                 ELSE s.new_conc END,
    changed_at = greatest(b.changed_at, b.throttled_at, b.limited_until)
                 + make_interval(secs => s.periods * p_quiet),
    updated_at = now()
FROM stepped s WHERE b.key = s.key;

WITH probe AS (
    SELECT b.key FROM budget b
    WHERE b.capped AND NOT b.backoff AND b.rate <= 0 AND b.concurrency <= 0 AND p_quiet > 0
      AND (p_keys IS NULL OR b.key = ANY (p_keys))
      AND greatest(b.changed_at, b.throttled_at) <= now() - make_interval(secs => 2 * p_quiet)
      AND EXISTS (SELECT 1 FROM recipient r WHERE r.status = 'queued' AND r.site = b.key)
    FOR UPDATE SKIP LOCKED
)
UPDATE budget b
SET effective_rate = CASE WHEN b.effective_rate > 0
                          THEN b.effective_rate + greatest(1, p_step * b.effective_rate)
                          ELSE 0 END,
    effective_concurrency = CASE WHEN b.effective_concurrency > 0
                                 THEN b.effective_concurrency + 1 ELSE 0 END,
    recover_rate = CASE WHEN b.effective_rate > 0
                        THEN b.effective_rate + greatest(1, p_step * b.effective_rate)
                        ELSE b.recover_rate END,
    recover_concurrency = CASE WHEN b.effective_concurrency > 0
                               THEN b.effective_concurrency + 1 ELSE b.recover_concurrency END,
    changed_at = now(),
    updated_at = now()
FROM probe WHERE b.key = probe.key;
$$;

-- As in migration 0026, STABLE (3 above).
CREATE OR REPLACE FUNCTION suspension_note(x suspension) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN x.kind = 'operator' THEN 'suspended by an operator: '
                WHEN x.key LIKE '%|org:%' THEN 'held for its org: '
                ELSE 'suspended after a reply: ' END
           || x.reason
           || CASE WHEN x.until IS NULL THEN ' (until resumed)'
                   ELSE ' (until ' || to_char(x.until AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
                        || ' UTC)' END
           || '; not attempted meanwhile'
$$;

-- As in migration 0024, with the org's room (4 above), and each row's org.
DROP FUNCTION site_pick(integer, text[], double precision[], double precision, double precision);
CREATE FUNCTION site_pick(p_limit integer, p_lanes text[], p_weights double precision[],
                          p_ahead double precision, p_probe double precision DEFAULT 60,
                          p_orgs uuid[] DEFAULT '{}', p_rooms integer[] DEFAULT '{}',
                          p_room integer DEFAULT NULL)
RETURNS TABLE (id uuid, delay double precision, org_id uuid)
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
    room_orgs uuid[] := p_orgs;
    org_rooms integer[] := p_rooms;
    po record;
    pos integer;
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
            id := NULL; delay := 0; org_id := NULL; RETURN NEXT;  -- more sites wait: claim again
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
                SELECT x.id, 0::float8, x.org_id FROM (
                    SELECT r.id, r.org_id FROM recipient r
                    WHERE r.status = 'queued' AND r.site = s.site AND r.next_attempt_at <= t
                      AND NOT suspended(r.org_id, r.lane)
                      AND coalesce(org_rooms[array_position(room_orgs, r.org_id)], p_room,
                                   p_limit) > 0
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
                       row_number() OVER (PARTITION BY g.lane ORDER BY random()) AS pick,
                       count(*) OVER (PARTITION BY g.org_id) AS org_lanes,
                       row_number() OVER (PARTITION BY g.org_id
                                          ORDER BY COALESCE(w.weight, 1.0) DESC, g.lane)
                           AS lane_pick
                FROM groups g
                LEFT JOIN unnest(p_lanes, p_weights) AS w (lane, weight) ON w.lane = g.lane
                WHERE g.oldest <= t AND NOT suspended(g.org_id, g.lane)
                  AND coalesce(org_rooms[array_position(room_orgs, g.org_id)], p_room,
                               p_limit) > 0
            ), lanes AS (
                SELECT l.lane, greatest(1, floor(room * l.weight / sum(l.weight) OVER ()))::int
                           AS share
                FROM (SELECT DISTINCT d.lane, d.weight FROM due d) l
            ), shares AS (
                SELECT d.org_id, d.lane, random() AS turn,
                       (l.share / d.orgs
                        + CASE WHEN d.pick <= l.share % d.orgs THEN 1 ELSE 0 END)::int AS share,
                       coalesce(org_rooms[array_position(room_orgs, d.org_id)], p_room,
                                p_limit) AS org_room,
                       d.org_lanes, d.lane_pick
                FROM due d JOIN lanes l USING (lane)
            ), group_rooms AS (
                -- The org's room, when less than the site's, split between its lanes (the
                -- heavier first for what does not divide), so that no group takes what another
                -- group of its org needs.
                SELECT sh.org_id, sh.lane, sh.turn, sh.share,
                       CASE WHEN sh.org_room >= room THEN sh.org_room
                            ELSE sh.org_room / sh.org_lanes
                                 + CASE WHEN sh.lane_pick <= sh.org_room % sh.org_lanes
                                        THEN 1 ELSE 0 END
                       END::int AS group_room
                FROM shares sh
            ), fair AS (
                SELECT x.id, x.next_attempt_at, sh.org_id, sh.lane, sh.turn, sh.share
                FROM (SELECT * FROM group_rooms WHERE share > 0 ORDER BY turn) sh
                CROSS JOIN LATERAL (
                    SELECT r.id, r.next_attempt_at FROM recipient r
                    WHERE r.status = 'queued' AND r.site = s.site AND r.org_id = sh.org_id
                      AND r.lane = sh.lane AND r.next_attempt_at <= t
                    ORDER BY r.next_attempt_at LIMIT least(sh.share, sh.group_room)
                    FOR UPDATE SKIP LOCKED) x
                LIMIT room
            ), fair_taken AS (
                SELECT f.org_id, f.lane, count(*)::int AS taken FROM fair f
                GROUP BY f.org_id, f.lane
            ), rest AS (
                SELECT x.id, x.next_attempt_at, sh.org_id, sh.lane, sh.turn, sh.share
                FROM (SELECT g.*, coalesce(ft.taken, 0) AS taken FROM group_rooms g
                      LEFT JOIN fair_taken ft ON ft.org_id = g.org_id AND ft.lane = g.lane
                      ORDER BY g.turn) sh
                CROSS JOIN LATERAL (
                    SELECT r.id, r.next_attempt_at FROM recipient r
                    WHERE r.status = 'queued' AND r.site = s.site AND r.org_id = sh.org_id
                      AND r.lane = sh.lane AND r.next_attempt_at <= t
                      AND r.id <> ALL (ARRAY (SELECT f.id FROM fair f))
                    ORDER BY r.next_attempt_at
                    LIMIT greatest(0, least(room, sh.group_room - sh.taken))
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
        -- What each org picked here is off its room at the next site.
        FOR po IN SELECT r.org_id AS org, count(*)::integer AS n FROM recipient r
                  WHERE r.id = ANY (picked) GROUP BY r.org_id
        LOOP
            pos := array_position(room_orgs, po.org);
            IF pos IS NULL THEN
                room_orgs := room_orgs || po.org;
                org_rooms := org_rooms || (coalesce(p_room, p_limit) - po.n);
            ELSE
                org_rooms[pos] := org_rooms[pos] - po.n;
            END IF;
        END LOOP;
        left_over := left_over - cardinality(picked);
        RETURN QUERY
            WITH p AS (
                SELECT u.id, u.i, r.message_id, r.org_id
                FROM unnest(picked) WITH ORDINALITY AS u (id, i) JOIN recipient r ON r.id = u.id
            ), k AS (
                SELECT p.message_id, rank() OVER (ORDER BY min(p.i)) AS k
                FROM p GROUP BY p.message_id
            )
            SELECT p.id, greatest(0, (k.k - have) / b.effective_rate)::float8, p.org_id
            FROM p JOIN k USING (message_id);
        IF n >= room AND room < left_over + cardinality(picked) THEN
            -- The budget's room is used up and more may wait: come back as it refills.
            id := NULL; delay := greatest(0.05, p_ahead / 2); RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
