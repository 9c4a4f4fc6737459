-- The TLS session a message arrived over (as the attempt log keeps it for deliveries), so that the
-- Reception events rebuilt by `pigeon-mta log` show it as the delivery log does.
ALTER TABLE message ADD COLUMN tls_version text, ADD COLUMN tls_cipher text;
