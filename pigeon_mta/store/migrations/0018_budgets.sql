-- Budgets shared by the whole cluster: message rates and SMTP session counts that every process
-- of every node takes grants from (store/budgets.py, outbound/budgets.py). A budget exists for a
-- [delivery.destination] entry with a rate or a concurrency, a lane with a rate, an org with a
-- rate, and any destination while it backs off after throttling replies.

-- An org's messages per second across the cluster (0: no limit), set by `org set ORG --rate N`.
ALTER TABLE org ADD COLUMN rate double precision NOT NULL DEFAULT 0;

-- Why a queued recipient was handed back unattempted (a budget without room, a destination
-- backing off); cleared when an attempt is recorded. `pigeon-mta log` shows it.
ALTER TABLE recipient ADD COLUMN postponed text;

CREATE TABLE budget (
    -- "destination:KEY" (outbound/limits.py's policy key), "lane:NAME" or "org:UUID"
    key                   text PRIMARY KEY,
    -- As configured (0: no limit); the engines that take grants write their configuration here.
    rate                  double precision NOT NULL DEFAULT 0,
    concurrency           integer NOT NULL DEFAULT 0,
    burst                 double precision NOT NULL DEFAULT 1,
    -- In force: the configured values, or less while the destination backs off (0: no limit).
    effective_rate        double precision NOT NULL DEFAULT 0,
    effective_concurrency integer NOT NULL DEFAULT 0,
    -- The token bucket, refilled at effective_rate up to a burst.
    tokens                double precision NOT NULL DEFAULT 0,
    refilled_at           timestamptz NOT NULL DEFAULT now(),
    -- Mail handed back for want of tokens is due one token apart up to here (store/budgets.py).
    booked_until          timestamptz NOT NULL DEFAULT now(),
    -- Adaptive backoff: the values it recovers to, the last decrease or recovery step, the last
    -- throttling reply, and a retry delay the destination stated.
    backoff               boolean NOT NULL DEFAULT false,
    recover_rate          double precision NOT NULL DEFAULT 0,
    recover_concurrency   integer NOT NULL DEFAULT 0,
    changed_at            timestamptz,
    throttled_at          timestamptz,
    held_until            timestamptz,
    last_reply            text,
    updated_at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX budget_backing_off ON budget (key) WHERE backoff;

-- SMTP sessions held against a budget's concurrency, per engine (`<node>/<run>`), under a lease:
-- a node killed outright holds its slots until their lease runs out, no longer.
CREATE TABLE budget_slot (
    key          text NOT NULL REFERENCES budget (key) ON DELETE CASCADE,
    holder       text NOT NULL,
    slots        integer NOT NULL,
    lease_until  timestamptz NOT NULL,
    PRIMARY KEY (key, holder)
);

-- Additive recovery of budgets backing off: after each quiet period without a throttling reply,
-- the effective rate and concurrency go up by `step` times what they recover to; once there, the
-- backoff ends. p_keys NULL: every budget backing off.
CREATE FUNCTION budget_recover(p_keys text[], p_step double precision, p_quiet double precision)
RETURNS void LANGUAGE sql AS $$
WITH due AS (
    SELECT b.key,
           floor(extract(epoch FROM now() - greatest(b.changed_at, b.throttled_at)) / p_quiet)
               AS periods,
           CASE WHEN b.rate > 0 THEN b.rate ELSE b.recover_rate END AS to_rate,
           CASE WHEN b.concurrency > 0 THEN b.concurrency ELSE b.recover_concurrency END AS to_conc
    FROM budget b
    WHERE b.backoff AND (p_keys IS NULL OR b.key = ANY (p_keys))
      AND greatest(b.changed_at, b.throttled_at) <= now() - make_interval(secs => p_quiet)
    -- A row another caller holds is that caller's to recover (or the next call's): no waiting,
    -- so no lock order to keep with budget_take's loop.
    FOR UPDATE SKIP LOCKED
), stepped AS (
    SELECT due.key, due.periods,
           least(due.to_rate, b.effective_rate + due.periods * p_step * due.to_rate) AS new_rate,
           least(due.to_conc, b.effective_concurrency
                 + greatest(1, ceil(due.periods * p_step * due.to_conc))::integer) AS new_conc,
           due.to_rate, due.to_conc
    FROM due JOIN budget b USING (key)
)
UPDATE budget b
SET backoff = NOT (s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc),
    effective_rate = CASE WHEN s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc
                          THEN b.rate ELSE s.new_rate END,
    effective_concurrency = CASE WHEN s.new_rate >= s.to_rate AND s.new_conc >= s.to_conc
                                 THEN b.concurrency ELSE s.new_conc END,
    changed_at = greatest(b.changed_at, b.throttled_at)
                 + make_interval(secs => s.periods * p_quiet),
    updated_at = now()
FROM stepped s WHERE b.key = s.key
$$;

-- One engine's grants for the budgets one claim round needs, in one call. For each key (in key
-- order, so that two callers never wait on each other in a cycle): the row is locked, the
-- configuration the caller has written in, the bucket refilled, up to p_tokens tokens and
-- p_slots more session slots granted. What is short is booked: `booked_from` is when the first
-- message handed back for want of tokens should find one (a message a token apart after it), so
-- that every engine spreads its handed-back mail over the refill instead of claiming it again at
-- once. A retry delay the destination stated (held_until) grants nothing until it has passed.
CREATE FUNCTION budget_take(
    p_keys text[], p_rates double precision[], p_concs integer[], p_bursts double precision[],
    p_tokens integer[], p_slots integer[], p_holder text, p_lease double precision,
    p_horizon double precision, p_step double precision, p_quiet double precision
) RETURNS TABLE (key text, tokens integer, slots integer, held integer,
                 booked_from timestamptz, effective_rate double precision,
                 effective_concurrency integer, held_until timestamptz)
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
BEGIN
    PERFORM budget_recover(p_keys, p_step, p_quiet);
    FOR v IN SELECT * FROM unnest(p_keys, p_rates, p_concs, p_bursts, p_tokens, p_slots)
             AS u (key, rate, conc, burst, want, want_slots) ORDER BY 1
    LOOP
        INSERT INTO budget AS t (key, rate, concurrency, burst, effective_rate,
                                 effective_concurrency, tokens)
        VALUES (v.key, v.rate, v.conc, v.burst, v.rate, v.conc, v.burst)
        ON CONFLICT ON CONSTRAINT budget_pkey DO NOTHING;
        SELECT * INTO b FROM budget t WHERE t.key = v.key FOR UPDATE;
        IF b.backoff THEN
            -- Backing off: below the configuration, never above it.
            IF v.rate > 0 THEN b.effective_rate := least(b.effective_rate, v.rate); END IF;
            IF v.conc > 0 THEN
                b.effective_concurrency := least(b.effective_concurrency, v.conc);
            END IF;
        ELSE
            b.effective_rate := v.rate;
            b.effective_concurrency := v.conc;
        END IF;
        on_hold := b.held_until IS NOT NULL AND b.held_until > now();
        -- Tokens: a burst of the configured size, or a second of the effective rate in backoff.
        granted := v.want;
        booked := now();
        IF b.effective_rate > 0 THEN
            burst := CASE WHEN b.backoff THEN greatest(1, b.effective_rate)
                          ELSE greatest(1, v.burst) END;
            b.tokens := least(burst, b.tokens
                + extract(epoch FROM now() - b.refilled_at) * b.effective_rate);
            granted := CASE WHEN on_hold THEN 0 ELSE least(v.want, floor(b.tokens)::integer) END;
            b.tokens := b.tokens - granted;
            IF granted < v.want THEN
                wait := greatest(0, 1 - b.tokens) / b.effective_rate;
                booked := greatest(now() + make_interval(secs => wait),
                                   least(b.booked_until, now() + make_interval(secs => p_horizon)));
                IF on_hold THEN booked := greatest(booked, b.held_until); END IF;
                b.booked_until := booked
                    + make_interval(secs => (v.want - granted) / b.effective_rate);
            END IF;
        ELSIF on_hold THEN
            granted := 0;
            booked := b.held_until;
        END IF;
        -- Session slots, leased per holder; lapsed leases of other holders are dropped here.
        granted_slots := v.want_slots;
        mine := 0;
        IF b.effective_concurrency > 0 THEN
            DELETE FROM budget_slot s WHERE s.key = v.key AND s.lease_until < now();
            SELECT coalesce(sum(s.slots) FILTER (WHERE s.holder <> p_holder), 0),
                   coalesce(sum(s.slots) FILTER (WHERE s.holder = p_holder), 0)
            INTO others, mine FROM budget_slot s WHERE s.key = v.key;
            granted_slots := CASE WHEN on_hold THEN 0 ELSE
                greatest(0, least(v.want_slots, b.effective_concurrency - others - mine)) END;
            IF granted_slots > 0 OR mine > 0 THEN
                INSERT INTO budget_slot AS s (key, holder, slots, lease_until)
                VALUES (v.key, p_holder, mine + granted_slots,
                        now() + make_interval(secs => p_lease))
                ON CONFLICT ON CONSTRAINT budget_slot_pkey DO UPDATE
                SET slots = excluded.slots, lease_until = excluded.lease_until;
            END IF;
        END IF;
        UPDATE budget t
        SET rate = v.rate, concurrency = v.conc, burst = v.burst,
            effective_rate = b.effective_rate, effective_concurrency = b.effective_concurrency,
            tokens = b.tokens, refilled_at = now(), booked_until = b.booked_until,
            updated_at = now()
        WHERE t.key = v.key;
        key := v.key;
        tokens := granted;
        slots := granted_slots;
        held := mine + granted_slots;
        booked_from := booked;
        effective_rate := b.effective_rate;
        effective_concurrency := b.effective_concurrency;
        held_until := b.held_until;
        RETURN NEXT;
    END LOOP;
END
$$;

-- What engines must ask for beyond their configuration, after the recovery of every budget backing
-- off: the orgs with a rate ('org', id, rate) and the budgets backing off ('backoff', key, rate).
CREATE FUNCTION budget_in_force(p_step double precision, p_quiet double precision)
RETURNS TABLE (kind text, key text, rate double precision)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM budget_recover(NULL, p_step, p_quiet);
    RETURN QUERY
        SELECT 'org'::text, o.id::text, o.rate FROM org o WHERE o.rate > 0
        UNION ALL
        SELECT 'backoff'::text, b.key, b.effective_rate FROM budget b WHERE b.backoff;
END
$$;
