-- budget_take counted each budget's refill from its statement's start (now()), though it may
-- have waited for the row's lock behind a caller that began later: that caller had moved
-- refilled_at past the waiter's now(), the waiter's elapsed time was negative (a negative grant)
-- and it moved refilled_at back, so the next caller was granted that stretch twice (1.95x and
-- 5.5x the rate with 8 and 16 callers). The time is now read once the row is locked
-- (clock_timestamp(), never before refilled_at), and used for every step of that budget.
--
-- A node killed outright held its session slots until their lease ran out (delivery.lease, 5 min
-- by default). A slot whose holder (`<node>/<run>#<pid>`) is not its node's live run any more (another
-- run took the name, it stopped, or its heartbeat is older than p_stale) is now dropped at once,
-- as the lapsed ones are: a dead node frees its destinations within its heartbeat's staleness.
DROP FUNCTION budget_take(text[], double precision[], integer[], double precision[], integer[],
                          integer[], text, double precision, double precision, double precision,
                          double precision);
CREATE FUNCTION budget_take(
    p_keys text[], p_rates double precision[], p_concs integer[], p_bursts double precision[],
    p_tokens integer[], p_slots integer[], p_holder text, p_lease double precision,
    p_horizon double precision, p_step double precision, p_quiet double precision,
    -- A default, so that nodes of the previous version, which call it with eleven arguments,
    -- keep working while a cluster is upgraded one node at a time (deploy/README.md).
    p_stale double precision DEFAULT 30
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
        -- The time is read now that the row is ours, never before: a caller that waited for the
        -- lock behind one that began later would count from before that one's refill.
        t := greatest(clock_timestamp(), b.refilled_at);
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
        on_hold := b.held_until IS NOT NULL AND b.held_until > t;
        -- Tokens: a burst of the configured size, or a second of the effective rate in backoff.
        granted := v.want;
        booked := t;
        IF b.effective_rate > 0 THEN
            burst := CASE WHEN b.backoff THEN greatest(1, b.effective_rate)
                          ELSE greatest(1, v.burst) END;
            -- (never below none: rows the earlier function left in debt start from empty)
            b.tokens := greatest(0, least(burst, b.tokens
                + extract(epoch FROM t - b.refilled_at) * b.effective_rate));
            granted := CASE WHEN on_hold THEN 0 ELSE least(v.want, floor(b.tokens)::integer) END;
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
        -- Session slots, leased per holder; lapsed leases of other holders are dropped here.
        granted_slots := v.want_slots;
        mine := 0;
        IF b.effective_concurrency > 0 THEN
            DELETE FROM budget_slot s
            WHERE s.key = v.key
              AND (s.lease_until < t
                   -- a holder (`<node>/<run>#<pid>`) that is not its node's live run; one
                   -- whose node has no row keeps its lease
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
            tokens = b.tokens, refilled_at = t, booked_until = b.booked_until,
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
        RETURN NEXT;
    END LOOP;
END
$$;
