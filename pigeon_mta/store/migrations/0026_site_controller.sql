-- One controller per site, fed by the whole cluster, and stated retry delays held per org.
--
-- 1. A throttling decrease starts from what the cluster was sending. A site without configured
--    limits has no budget row until it throttles us; the engines' reports then say what each of
--    them was sending (store/budgets.py, report_throttling). Every engine that reports within the
--    hold of one decrease adds its rate and sessions to it (`reporters`): the decrease halves the
--    cluster's rate, not the first reporter's (which left a 50/s server at 5.5/s with two
--    processes). A budget that was already pacing (`base_rate`) decreases from its own rate.
-- 2. Where recovery stops. A site with configured limits recovers to them. One without recovers
--    to the rate it was throttled at (`recover_rate`, set by every decrease, not only the first),
--    and is then capped there. A capped site whose mail waits in its queue probes upward: each
--    two quiet periods without a throttling reply add `step` of its rate (at least 1/s) and one
--    session. The next throttling reply finds the server's limit again, from just above it.
-- 3. A retry delay a reply states ("try again in 5 minutes") holds the site for the org whose
--    mail got it, not for every org: a suspension of kind 'reply' keyed `SITE|org:UUID`
--    (store/suspensions.py); its mail waits in the queue of that key and goes back to the
--    general claim when the hold ends (site_pick finds no budget of that key). The budget's
--    `held_until` is no longer written.
-- 4. A reply rule's limit (`[[shaping.rule]]` action rate or sessions, budget_limit): the site's
--    effective rate or sessions at most that until `limited_until`, in backoff; its recovery
--    starts a quiet period after that.

ALTER TABLE budget ADD COLUMN reporters text[] NOT NULL DEFAULT '{}';
ALTER TABLE budget ADD COLUMN reported_rate double precision NOT NULL DEFAULT 0;
ALTER TABLE budget ADD COLUMN reported_concurrency integer NOT NULL DEFAULT 0;
ALTER TABLE budget ADD COLUMN base_rate double precision NOT NULL DEFAULT 0;
ALTER TABLE budget ADD COLUMN base_concurrency integer NOT NULL DEFAULT 0;
ALTER TABLE budget ADD COLUMN limited_until timestamptz;

-- Throttling replies of one report round, one row per key (in key order: budget_take's lock
-- order). A decrease at most once per p_hold seconds: the replies of one overload arrive together
-- and are one signal; within the hold, an engine not yet counted adds what it was sending.
CREATE FUNCTION budget_throttled(
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
BEGIN
    FOR v IN SELECT * FROM unnest(p_keys, p_holders, p_rates, p_concs, p_replies)
             AS u (key, holder, rate, conc, reply) ORDER BY 1
    LOOP
        INSERT INTO budget AS u (key, tokens) VALUES (v.key, 0)
        ON CONFLICT ON CONSTRAINT budget_pkey DO NOTHING;
        SELECT * INTO b FROM budget u WHERE u.key = v.key FOR UPDATE;
        t := clock_timestamp();
        IF NOT (b.backoff AND b.changed_at > t - make_interval(secs => p_hold)) THEN
            -- A new decrease: from the rate in force, or (none) from the reports.
            b.base_rate := greatest(0, b.effective_rate);
            b.base_concurrency := greatest(0, b.effective_concurrency);
            b.reporters := ARRAY[v.holder];
            b.reported_rate := greatest(1, v.rate);
            b.reported_concurrency := greatest(1, v.conc);
            b.tokens := least(b.tokens, 0);
            b.changed_at := t;
        ELSIF v.holder <> ALL (b.reporters) THEN
            b.reporters := b.reporters || v.holder;
            b.reported_rate := b.reported_rate + greatest(1, v.rate);
            b.reported_concurrency := b.reported_concurrency + greatest(1, v.conc);
        END IF;
        from_rate := CASE WHEN b.base_rate > 0 THEN b.base_rate ELSE b.reported_rate END;
        from_conc := CASE WHEN b.base_concurrency > 0 THEN b.base_concurrency
                          ELSE b.reported_concurrency END;
        UPDATE budget u
        SET effective_rate = greatest(1, from_rate * p_factor),
            effective_concurrency = greatest(1, floor(from_conc * p_factor))::integer,
            recover_rate = from_rate,
            recover_concurrency = from_conc,
            base_rate = b.base_rate, base_concurrency = b.base_concurrency,
            reporters = b.reporters, reported_rate = b.reported_rate,
            reported_concurrency = b.reported_concurrency,
            tokens = b.tokens, changed_at = b.changed_at,
            backoff = true, capped = false, throttled_at = t, last_reply = v.reply,
            updated_at = t
        WHERE u.key = v.key;
    END LOOP;
END
$$;

-- Additive recovery after the quiet period, as in migration 0024 but counted from the end of a
-- rule's limit, and a site that never throttled us ends it at no limit, not capped at none; then,
-- for a capped site with mail waiting in its queue, the upward probe.
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
    WHERE b.backoff AND (p_keys IS NULL OR b.key = ANY (p_keys))
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
    WHERE b.capped AND NOT b.backoff AND b.rate <= 0 AND b.concurrency <= 0
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
    changed_at = now(),
    updated_at = now()
FROM probe WHERE b.key = probe.key;
$$;

-- A reply rule's limit: at most p_rate messages a second (0: the rate unchanged) and p_conc
-- sessions (0: unchanged) until p_seconds from now, for the whole cluster; then recovery as after
-- a throttling reply, to the configured values, or (none) to where its last throttling reply
-- capped it, or if it never throttled us, to no limit.
CREATE FUNCTION budget_limit(p_key text, p_rate double precision, p_conc integer,
                             p_seconds double precision, p_reply text)
RETURNS void LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    b budget;
    t timestamptz;
BEGIN
    INSERT INTO budget AS u (key, tokens) VALUES (p_key, 0)
    ON CONFLICT ON CONSTRAINT budget_pkey DO NOTHING;
    SELECT * INTO b FROM budget u WHERE u.key = p_key FOR UPDATE;
    t := clock_timestamp();
    UPDATE budget u
    SET effective_rate = CASE WHEN p_rate <= 0 THEN b.effective_rate
                              WHEN b.effective_rate > 0 THEN least(b.effective_rate, p_rate)
                              ELSE p_rate END,
        effective_concurrency = CASE
            WHEN p_conc <= 0 THEN b.effective_concurrency
            WHEN b.effective_concurrency > 0 THEN least(b.effective_concurrency, p_conc)
            ELSE p_conc END,
        tokens = least(b.tokens, 1),
        backoff = true, capped = false,
        limited_until = greatest(b.limited_until, t + make_interval(secs => p_seconds)),
        changed_at = t, last_reply = p_reply, updated_at = t
    WHERE u.key = p_key;
END
$$;

-- Who set a suspension: an operator (`queue suspend`) or a reply ('reply': a stated retry delay
-- or a reply rule's suspend action, for one org at one site, key SITE|org:UUID, or a rule's for
-- every org, the site's key).
ALTER TABLE suspension ADD COLUMN kind text NOT NULL DEFAULT 'operator';

-- What a suspension says of the mail it holds (`log`, and the reason engines hand it back with).
CREATE FUNCTION suspension_note(x suspension) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN x.kind = 'operator' THEN 'suspended by an operator: '
                WHEN x.key LIKE '%|org:%' THEN 'held for its org: '
                ELSE 'suspended after a reply: ' END
           || x.reason
           || CASE WHEN x.until IS NULL THEN ' (until resumed)'
                   ELSE ' (until ' || to_char(x.until AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
                        || ' UTC)' END
           || '; not attempted meanwhile'
$$;

-- As in migration 0024, with each suspension's note from suspension_note.
CREATE OR REPLACE FUNCTION budget_in_force(p_step double precision, p_quiet double precision)
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
        SELECT 'suspended'::text, x.key, 0::float8, suspension_note(x)
        FROM suspension x WHERE x.until IS NULL OR x.until > now();
END
$$;
