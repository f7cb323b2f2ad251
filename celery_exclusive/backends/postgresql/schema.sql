-- celery-exclusive lease store for PostgreSQL, schema version 1.
--
-- Created on first use by a role allowed to create tables. Where the workers' role
-- may not, run this file once as the owner (psql -f, or
-- celery_exclusive.backends.postgresql.migrate(url)), in the schema named by the
-- store URL's ?schema= option (SET search_path TO <schema> first), then grant the
-- workers' role SELECT, INSERT, UPDATE, DELETE on these five tables.
--
-- Keys, mark kinds' values and record names are stored as bytes (UTF-8): a key may
-- hold any character, NUL included, which PostgreSQL's text type refuses. Rows are
-- found by key_id, the SHA-256 of the key: fixed width, so that no key is too long
-- for an index and no key can name another key's rows.

-- One row per live grant (a semaphore has one per holder). Expired rows are deleted
-- by the next grant of their key; nothing reads them in the meantime.
CREATE TABLE IF NOT EXISTS exclusive_leases (
    key_id bytea NOT NULL,
    owner text NOT NULL,
    key bytea NOT NULL,
    fencing_token bigint NOT NULL,
    lease_limit integer NOT NULL,
    expires_at timestamptz NOT NULL,
    holder text NOT NULL,
    PRIMARY KEY (key_id, owner)
);

-- The last fencing token granted per key. Never deleted: a key's next token is
-- GREATEST(counter + 1, the database clock in microseconds), so tokens rise across
-- deletes, restarts and even a restore that lost this row.
CREATE TABLE IF NOT EXISTS exclusive_fences (
    key_id bytea PRIMARY KEY,
    counter bigint NOT NULL
);

-- Marks: small values with an expiry (a key's line of waiters, its pending rerun).
CREATE TABLE IF NOT EXISTS exclusive_marks (
    key_id bytea NOT NULL,
    kind text NOT NULL,
    value bytea NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (key_id, kind)
);

-- Records: values only a holder of the key writes (the beat leader's last sends).
CREATE TABLE IF NOT EXISTS exclusive_records (
    key_id bytea NOT NULL,
    name bytea NOT NULL,
    value bytea NOT NULL,
    PRIMARY KEY (key_id, name)
);

CREATE TABLE IF NOT EXISTS exclusive_schema (
    version integer NOT NULL
);
INSERT INTO exclusive_schema (version) SELECT 1 WHERE NOT EXISTS (SELECT FROM exclusive_schema);
