-- At most one active DKIM key per sender domain and algorithm: the key that signs. Rotation is
-- "add a new selector (inactive), publish its record, activate it" — activating a key retires the
-- domain's other active key of the same algorithm in the same transaction. A domain may still
-- have one active RSA key and one active Ed25519 key; mail then carries both signatures.
CREATE UNIQUE INDEX dkim_key_one_active ON dkim_key (domain_id, algorithm) WHERE active;
