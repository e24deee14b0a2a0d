//! Schema and table names, migrations, and the SQL text built from them.

use std::sync::OnceLock;

use outbox_api::activity::ActivitySql;
use outbox_api::backend::{validate_schema_name, validate_table_name};
use outbox_api::{Error, Result};

use crate::claim_sql::{CLAIM_SETTINGS, RETRIES_GENERATION, claim_sql, floor_cte, sequences};
use crate::own_lock::own_lock_column;

/// Default PostgreSQL schema.
pub const DEFAULT_SCHEMA: &str = "public";
/// Default outbox table name.
pub const DEFAULT_OUTBOX_TABLE: &str = "outbox";
/// Default inbox table name.
pub const DEFAULT_INBOX_TABLE: &str = "outbox_inbox";
/// The table, in each schema, that records which migrations were applied to
/// which table.
pub(crate) use outbox_api::backend::MIGRATIONS_TABLE as VERSIONS_TABLE;

/// A validated schema + outbox table + inbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Names {
    pub schema: String,
    pub outbox: String,
    pub inbox: String,
}

impl Names {
    pub(crate) fn new(schema: &str, outbox: &str, inbox: &str) -> Result<Names> {
        validate_schema_name("schema", schema)?;
        validate_table_name("table", outbox)?;
        validate_table_name("inbox_table", inbox)?;
        if outbox == inbox {
            return Err(Error::config(
                "inbox_table",
                format!("the inbox table must differ from the outbox table `{outbox}`"),
            ));
        }
        Ok(Names {
            schema: schema.to_owned(),
            outbox: outbox.to_owned(),
            inbox: inbox.to_owned(),
        })
    }

    /// `schema.outbox`, for messages.
    pub(crate) fn outbox_display(&self) -> String {
        format!("{}.{}", self.schema, self.outbox)
    }

    /// `schema.inbox`, for messages.
    pub(crate) fn inbox_display(&self) -> String {
        format!("{}.{}", self.schema, self.inbox)
    }

    /// The NOTIFY channel of the outbox table: `outbox.<schema>.<table>`
    /// when that fits PostgreSQL's 63 bytes, else a name derived from a hash.
    pub(crate) fn channel(&self) -> String {
        let readable = format!("outbox.{}.{}", self.schema, self.outbox);
        if readable.len() <= 63 {
            readable
        } else {
            format!("outbox.{:016x}", fnv1a(&readable))
        }
    }

    /// The seed of the per-key advisory locks enqueues take.
    pub(crate) fn key_lock_seed(&self) -> i64 {
        fnv1a(&format!("outbox-rs key {}.{}", self.schema, self.outbox)) as i64
    }
}

/// The advisory lock that serialises migrations, across every schema.
pub(crate) fn migration_lock() -> i64 {
    fnv1a("outbox-rs migrations") as i64
}

/// FNV-1a, 64 bits: a stable hash (unlike `std`'s), so every process derives
/// the same lock keys from the same names.
pub(crate) fn fnv1a(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The columns every message query returns, in the order `row::decode`
/// reads them.
pub(crate) const COLUMNS: &str = "seq, id, kind, message_type, key, exchange, routing_key, payload, \
     content_type, headers::text, trace_parent, created_at, available_at, attempts, last_error, \
     state, locked_by, locked_until, processed_at";

/// Migrations of the outbox table, in order; `{s}` is the schema, `{t}` the
/// table (both validated, spliced quoted).
const OUTBOX_MIGRATIONS: &[&str] = &[
    // 1: the table and the partial indexes that keep claims proportional to
    // the batch. `seq` orders a key's messages; enqueues of one key take a
    // per-key advisory lock before drawing it, so a key's `seq` order is its
    // commit order (docs/decisions.md). Times are milliseconds since the
    // Unix epoch, as the relay's clock gives them.
    //
    // The table is hot: every message is inserted, leased, marked and
    // purged. Autovacuum is set per table to clean it after 1 % of its rows
    // changed (the default waits for 20 %) and at full speed (no cost
    // delay), so dead tuples never pile up in front of the claim; the fill
    // factor leaves room on each page for the lease updates, which touch
    // no indexed column and so stay heap-only (HOT): 80 here, 50 since
    // migration 4.
    r#"CREATE TABLE IF NOT EXISTS "{s}"."{t}" (
        seq           bigserial PRIMARY KEY,
        id            uuid      NOT NULL UNIQUE,
        kind          text      NOT NULL CHECK (kind IN ('domain', 'integration')),
        message_type  text      NOT NULL,
        key           text,
        exchange      text,
        routing_key   text,
        payload       bytea     NOT NULL,
        content_type  text      NOT NULL,
        headers       jsonb,
        trace_parent  text,
        created_at    bigint    NOT NULL,
        available_at  bigint    NOT NULL,
        attempts      integer   NOT NULL DEFAULT 0,
        last_error    text,
        state         text      NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'processed', 'poisoned')),
        locked_by     text,
        locked_until  bigint,
        processed_at  bigint
    ) WITH (
        fillfactor = 80,
        autovacuum_vacuum_scale_factor = 0.01,
        autovacuum_vacuum_insert_scale_factor = 0.01,
        autovacuum_analyze_scale_factor = 0.02,
        autovacuum_vacuum_cost_delay = 0
    );
    CREATE INDEX IF NOT EXISTS "{t}_pending_idx" ON "{s}"."{t}" (seq) WHERE state = 'pending';
    CREATE INDEX IF NOT EXISTS "{t}_poisoned_idx" ON "{s}"."{t}" (seq) WHERE state = 'poisoned';
    CREATE INDEX IF NOT EXISTS "{t}_key_idx" ON "{s}"."{t}" (key, seq) WHERE key IS NOT NULL AND state <> 'processed';
    CREATE INDEX IF NOT EXISTS "{t}_processed_idx" ON "{s}"."{t}" (processed_at) WHERE state = 'processed';"#,
    // 2: what the claim's floor needs (src/floor.rs). The `_retries`
    // sequence is advanced by every operator retry, which makes a message
    // pending again below the floor; claims compare it with the generation
    // their floor was set under. The poisoned messages of each key get an
    // index of their own, so that the claim's test "an earlier message of
    // this key is poisoned" never walks the entries of completed ones.
    r#"CREATE SEQUENCE IF NOT EXISTS "{s}"."{t}_retries" AS bigint CACHE 1;
    CREATE INDEX IF NOT EXISTS "{t}_poisoned_keys" ON "{s}"."{t}" (key, seq) WHERE key IS NOT NULL AND state = 'poisoned';"#,
    // 3: when a message last failed (`Store::fail`, or poisoned as a
    // corrupt row), for the console's activity charts
    // (outbox_api::activity). A column without a default: no rewrite.
    r#"ALTER TABLE "{s}"."{t}" ADD COLUMN IF NOT EXISTS failed_at bigint;"#,
    // 4: pages filled to half by inserts, so that every message on a page
    // can be leased once without leaving it. A lease touches no indexed
    // column and stays heap-only (HOT) when its new version fits on the
    // page; at 80 % a page had room for about a quarter of its messages'
    // leases, and the rest wrote an entry into three indexes each: a claim
    // of 500 took 8.5 ms against 2.5–3.9 ms at 50 % (`EXPLAIN ANALYZE`
    // over 100k pending, docs/decisions.md, "half-full pages"). New pages
    // only; the pages already written keep their fill.
    r#"ALTER TABLE "{s}"."{t}" SET (fillfactor = 50);"#,
];

/// Migrations of the inbox table, in order.
const INBOX_MIGRATIONS: &[&str] = &[
    // 1: one row per (consumer, message) handled.
    r#"CREATE TABLE IF NOT EXISTS "{s}"."{t}" (
        consumer     text   NOT NULL,
        message_id   uuid   NOT NULL,
        received_at  bigint NOT NULL,
        PRIMARY KEY (consumer, message_id)
    ) WITH (
        autovacuum_vacuum_scale_factor = 0.01,
        autovacuum_vacuum_cost_delay = 0
    );
    CREATE INDEX IF NOT EXISTS "{t}_received_idx" ON "{s}"."{t}" (received_at);"#,
];

/// Which migrations apply to a table.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TableKind {
    Outbox,
    Inbox,
}

impl TableKind {
    pub(crate) fn migrations(self) -> &'static [&'static str] {
        match self {
            TableKind::Outbox => OUTBOX_MIGRATIONS,
            TableKind::Inbox => INBOX_MIGRATIONS,
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            TableKind::Outbox => "outbox",
            TableKind::Inbox => "inbox",
        }
    }

    /// Migration `sql` for `table` in `schema`.
    pub(crate) fn render(sql: &str, schema: &str, table: &str) -> String {
        sql.replace("{s}", schema).replace("{t}", table)
    }
}

/// The SQL text of one outbox + inbox pair, built once from validated names.
#[derive(Debug)]
pub(crate) struct Sql {
    pub names: Names,
    /// `BEGIN` and the claim's settings, in one round trip.
    pub begin_claim: String,
    pub insert: String,
    pub insert_keyed: String,
    pub complete: String,
    pub fail: String,
    pub release: String,
    pub release_worker: String,
    pub purge: String,
    pub count_state: String,
    pub oldest_pending: String,
    /// The floor's candidate (src/floor.rs): retry generation, last `seq`
    /// drawn, a fresh transaction id, the `seq` sequence's cache size.
    pub floor_candidate: String,
    /// The floor's check (`$1` the candidate's transaction id, `$2` the
    /// lowest `seq` to look from): ready, and the lowest pending `seq`.
    pub floor_check: String,
    /// Whether enqueues take their transaction's own lock (`OWN_LOCK`):
    /// only when their commits are announced, since only the commit
    /// watcher waits for it.
    own_lock: bool,
    /// [`NO_FLUSH`], or `true` with durable bookkeeping: the claim carries
    /// it, for when it runs as its own transaction.
    no_flush: &'static str,
    /// Built on first use.
    rare: OnceLock<Rare>,
}

/// "The message is pending", for statements that find their messages by
/// id. Written so that it does not match the pending index's predicate
/// (`state = 'pending'`; the table's CHECK allows only the three states):
/// with `state = 'pending'` a generic plan walked the whole pending index,
/// filtering by id, instead of looking the ids up — and under a long
/// transaction that index holds an entry for every message completed since
/// (700 ms per completion in the bench, against 0.1 ms).
const PENDING_BY_ID: &str = "state NOT IN ('processed', 'poisoned')";

/// A condition, true, whose evaluation sets `synchronous_commit = off` for
/// the rest of the transaction. It refers to no row, so PostgreSQL
/// evaluates it once, before the statement reads anything (a one-time
/// filter), also when no row matches. A statement of the relay's
/// bookkeeping that carries it commits without waiting for a WAL flush,
/// also when it runs alone (its own transaction). A server crash may then
/// take back its effect — a message completed, purged — if it came in the
/// last few hundred milliseconds; the message is delivered again, or
/// purged again (docs/rules.md, "Server crash").
const NO_FLUSH: &str = "(SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL";

/// The values an insert binds, in this order: `$1` id, `$2` kind, `$3`
/// message_type, `$4` key, `$5` exchange, `$6` routing_key, `$7` payload,
/// `$8` content_type, `$9` headers (JSON text), `$10` trace_parent, `$11`
/// created_at, `$12` available_at.
const INSERT_COLUMNS: &str = "id, kind, message_type, key, exchange, routing_key, payload, \
     content_type, headers, trace_parent, created_at, available_at";

impl Sql {
    /// The statements of `names`; with `durable_bookkeeping` the relay's
    /// own commits wait for a WAL flush like any other (see
    /// [`NO_FLUSH`]); without `keep_processed` a completion deletes the
    /// message.
    pub(crate) fn new(
        names: Names,
        durable_bookkeeping: bool,
        keep_processed: bool,
        own_lock: bool,
    ) -> Sql {
        let s = &names.schema;
        let lock = own_lock_column(own_lock);
        let t = format!(r#""{s}"."{}""#, names.outbox);
        let seed = names.key_lock_seed();
        let values = "$1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12";
        let (retries, seqs) = sequences(&names);
        let retries_generation = RETRIES_GENERATION;
        let (no_flush, set_no_flush) = if durable_bookkeeping {
            ("true", "")
        } else {
            (NO_FLUSH, "SET LOCAL synchronous_commit = off; ")
        };
        let mut sql = Sql {
            // A claim never waits for a row another transaction holds (it
            // skips it); the lock timeout bounds anything else in its
            // transaction, and a claim whose client went silent
            // mid-transaction is cut off after 10 s, releasing its rows.
            //
            // The claim must walk the pending index in `seq` order and stop
            // at its LIMIT. With statistics that lag the table (a backlog
            // that grew faster than autovacuum analyses it, or a generic
            // plan cached while the table was small) the planner would
            // rather fetch every pending row, test each one's key, and sort
            // them: 2 s per claim at 100k pending instead of 0.5 ms
            // (docs/decisions.md). Neither a sort nor a bitmap scan ever
            // serves it, so both are off for these short transactions, as
            // is a sequential scan of the table.
            //
            // The plan is the statement's generic one, made once per
            // connection and kept with its prepared statement
            // (`plan_cache_mode = force_generic_plan`): the pinned walk
            // above does not depend on the parameters, and a custom plan
            // cost more than the claim itself (2 ms of planning against
            // 3 ms of execution for a claim of 500; 0.4 against 0.06 ms
            // for one message). JIT is off: a generic plan's estimates
            // assume the LIMIT takes the whole table, which crosses
            // `jit_above_cost` and compiled every claim for 30 ms
            // (docs/decisions.md, "the claim's plan is generic").
            //
            // The relay's own bookkeeping never waits for a WAL flush
            // (`synchronous_commit = off`, for these transactions only):
            // what a server crash can take back of it is a suffix of the
            // last few hundred milliseconds, which costs redeliveries and
            // nothing else (docs/rules.md, "Server crash").
            begin_claim: format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = '10s'; {set_no_flush}{}",
                CLAIM_SETTINGS
                    .iter()
                    .map(|(name, value)| format!("SET LOCAL {name} = '{value}'"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            // Every insert takes its transaction's id before it draws a
            // `seq` (the materialized `first` is evaluated before the row is
            // made): the claim's floor relies on it (src/floor.rs).
            insert: format!(
                "WITH first AS MATERIALIZED (SELECT pg_current_xact_id() AS xid{lock}) \
                 INSERT INTO {t} ({INSERT_COLUMNS}) SELECT {values} FROM first \
                 RETURNING pg_current_xact_id()::text"
            ),
            // The key's lock is taken in `first` too, before the row (and
            // its `seq`) is made: a later enqueue of the key waits for this
            // transaction to end, then draws a higher `seq`.
            insert_keyed: format!(
                "WITH first AS MATERIALIZED (SELECT pg_current_xact_id() AS xid{lock}, \
                   pg_advisory_xact_lock(hashtextextended($4, {seed})) AS key_lock) \
                 INSERT INTO {t} ({INSERT_COLUMNS}) SELECT {values} FROM first \
                 RETURNING pg_current_xact_id()::text"
            ),
            // One statement in its own transaction, whose commit does not
            // wait for a flush. Deleting writes no new row version: every
            // test of a key's order reads a missing message as a processed
            // one ("not processed" rows are the ones that stand in the way).
            // Both forms take the same parameters; the DELETE only checks
            // that `$1` is bound.
            complete: if keep_processed {
                format!(
                    "UPDATE {t} SET state = 'processed', processed_at = $1, \
                     locked_by = NULL, locked_until = NULL \
                     WHERE id = ANY($2) AND {PENDING_BY_ID} AND {no_flush}"
                )
            } else {
                format!(
                    "DELETE FROM {t} WHERE id = ANY($2) AND {PENDING_BY_ID} AND $1::int8 IS NOT NULL \
                     AND {no_flush}"
                )
            },
            // Failures and releases are single statements, in
            // transactions of their own, taking no lock beyond their rows:
            // a claim running beside one judges the message by its own
            // snapshot, leased or not yet claimable, and either way takes
            // none of its key's later messages (see `claim_sql`).
            fail: format!(
                "UPDATE {t} SET attempts = attempts + 1, last_error = $1,
                   state = CASE WHEN attempts + 1 >= $2 THEN 'poisoned' ELSE 'pending' END,
                   available_at = CASE WHEN attempts + 1 >= $2 THEN available_at ELSE $3 END,
                   locked_by = NULL, locked_until = NULL, failed_at = $6
                 WHERE id = $4 AND {PENDING_BY_ID} AND locked_by = $5 AND {no_flush}
                 RETURNING attempts, state"
            ),
            release: format!(
                "UPDATE {t} SET locked_by = NULL, locked_until = NULL,
                   available_at = $1, last_error = COALESCE($2, last_error)
                 WHERE id = ANY($3) AND {PENDING_BY_ID} AND locked_by = $4 AND {no_flush}"
            ),
            release_worker: format!(
                "UPDATE {t} SET locked_by = NULL, locked_until = NULL
                 WHERE state = 'pending' AND locked_by = $1 AND {no_flush}"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE seq IN (
                   SELECT seq FROM {t} WHERE state = 'processed' AND processed_at < $1
                   ORDER BY processed_at LIMIT $2) AND {no_flush}"
            ),
            // Each state in the text, so that each count reads its own
            // partial index, even under a generic plan: with `state = $1`
            // the plan is a scan of the whole table, kept messages and
            // all (212 ms against 0.07 ms over 100,000 processed rows).
            // Only the chosen branch runs; any other `$1` gives NULL.
            count_state: format!(
                "SELECT CASE $1::text \
                   WHEN 'pending' THEN (SELECT count(*) FROM {t} WHERE state = 'pending') \
                   WHEN 'poisoned' THEN (SELECT count(*) FROM {t} WHERE state = 'poisoned') \
                   WHEN 'processed' THEN (SELECT count(*) FROM {t} WHERE state = 'processed') END"
            ),
            // From the claim's floor (`$1`, `$2`), as the claim walks.
            oldest_pending: format!(
                "WITH {floor} SELECT created_at FROM {t} \
                 WHERE state = 'pending' AND seq >= (SELECT seq FROM floor) ORDER BY seq LIMIT 1",
                floor = floor_cte(&names, 1)
            ),
            // Taking a transaction id writes no WAL, so this statement's
            // commit waits for no flush (300 of them: one
            // `pg_stat_wal.wal_sync`).
            floor_candidate: format!(
                "SELECT {retries_generation},
                        CASE WHEN s.is_called THEN s.last_value ELSE s.last_value - 1 END,
                        pg_current_xact_id()::text,
                        (SELECT seqcache FROM pg_sequence WHERE seqrelid = '{seqs}'::regclass)
                 FROM {retries} AS r, {seqs} AS s"
            ),
            floor_check: format!(
                "SELECT pg_snapshot_xmin(pg_current_snapshot()) > $1::text::xid8,
                   CASE WHEN pg_snapshot_xmin(pg_current_snapshot()) > $1::text::xid8 THEN
                     (SELECT min(seq) FROM {t} WHERE state = 'pending' AND seq >= $2) END"
            ),
            own_lock,
            no_flush,
            rare: OnceLock::new(),
            names,
        };
        // `format!` leaves up to half of each string's buffer unused; a
        // store keeps these for its life, one store per tenant in a fleet.
        for text in [
            &mut sql.begin_claim,
            &mut sql.insert,
            &mut sql.insert_keyed,
            &mut sql.complete,
            &mut sql.fail,
            &mut sql.release,
            &mut sql.release_worker,
            &mut sql.purge,
            &mut sql.count_state,
            &mut sql.oldest_pending,
            &mut sql.floor_candidate,
            &mut sql.floor_check,
        ] {
            text.shrink_to_fit();
        }
        sql
    }

    /// The statements built on first use ([`Rare`]).
    pub(crate) fn rare(&self) -> &Rare {
        self.rare
            .get_or_init(|| Rare::new(&self.names, self.own_lock))
    }

    /// The claim statement; see [`claim_sql`].
    pub(crate) fn claim(&self) -> String {
        let mut claim = claim_sql(&self.names, self.no_flush);
        claim.shrink_to_fit();
        claim
    }
}

/// Statements of the operators, the inbox, batch enqueues and corrupt rows:
/// built on first use, so that a store that never runs them (a tenant's
/// store in a fleet's relay) does not keep their text (about 4.7 KB).
#[derive(Debug)]
pub(crate) struct Rare {
    pub insert_many: String,
    pub receive: String,
    pub purge_inbox: String,
    pub poison_seq: String,
    pub unlock_seq: String,
    pub list: String,
    pub get: String,
    pub state_of: String,
    /// The console's activity counts (`outbox_api::activity`).
    pub activity: ActivitySql,
    pub retry: String,
    pub discard: String,
}

impl Rare {
    fn new(names: &Names, own_lock: bool) -> Rare {
        let lock = own_lock_column(own_lock);
        let s = &names.schema;
        let t = format!(r#""{s}"."{}""#, names.outbox);
        let i = format!(r#""{s}"."{}""#, names.inbox);
        let seed = names.key_lock_seed();
        let (retries, _) = sequences(names);
        Rare {
            // The transaction's id and every key's lock first, the locks
            // in byte order of the keys (the order the crate docs ask of
            // transactions that enqueue several keys one by one, so that
            // they never deadlock with a batch), then the rows in the order
            // given.
            insert_many: format!(
                "WITH key_locks AS MATERIALIZED (
                   SELECT count(*) AS n, pg_current_xact_id() AS xid{lock} FROM (
                     SELECT pg_advisory_xact_lock(hashtextextended(k, {seed})) FROM (
                       SELECT DISTINCT k COLLATE \"C\" AS k
                       FROM unnest($4::text[]) AS k WHERE k IS NOT NULL ORDER BY 1) AS keys
                   ) AS locked),
                 inserted AS (
                   INSERT INTO {t} ({INSERT_COLUMNS})
                   SELECT m.id, m.kind, m.message_type, m.key, m.exchange, m.routing_key, m.payload,
                          m.content_type, m.headers::jsonb, m.trace_parent, m.created_at, m.available_at
                   FROM key_locks,
                        unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                               $7::bytea[], $8::text[], $9::text[], $10::text[], $11::int8[], $12::int8[])
                          WITH ORDINALITY AS m(id, kind, message_type, key, exchange, routing_key,
                               payload, content_type, headers, trace_parent, created_at,
                               available_at, ord)
                   ORDER BY m.ord
                   RETURNING 1)
                 SELECT pg_current_xact_id()::text, (SELECT count(*) FROM inserted)"
            ),
            receive: format!(
                "INSERT INTO {i} (consumer, message_id, received_at) VALUES ($1, $2, $3) \
                 ON CONFLICT DO NOTHING"
            ),
            purge_inbox: format!(
                "DELETE FROM {i} WHERE (consumer, message_id) IN (
                   SELECT consumer, message_id FROM {i} WHERE received_at < $1
                   ORDER BY received_at LIMIT $2)"
            ),
            poison_seq: format!(
                "UPDATE {t} SET state = 'poisoned', last_error = $1, locked_by = NULL, \
                 locked_until = NULL, failed_at = $3 WHERE seq = $2"
            ),
            unlock_seq: format!(
                "UPDATE {t} SET locked_by = NULL, locked_until = NULL WHERE seq = $1"
            ),
            list: format!(
                "SELECT {COLUMNS} FROM {t}
                 WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR message_type = $2)
                 AND ($5::text IS NULL OR substr(trace_parent, 4, 32) = $5)
                 ORDER BY seq LIMIT $3 OFFSET $4"
            ),
            get: format!("SELECT {COLUMNS} FROM {t} WHERE id = $1"),
            state_of: format!("SELECT state, last_error FROM {t} WHERE id = $1 FOR UPDATE"),
            activity: ActivitySql::new(&t),
            // A retried message is pending again, maybe below the claim's
            // floor: the `_retries` sequence moves on (after the row is
            // locked, so with this transaction's id taken), and claims stop
            // trusting floors set before (src/floor.rs).
            retry: format!(
                "UPDATE {t} SET state = 'pending', attempts = 0, available_at = $1, last_error = $2,
                   locked_by = NULL, locked_until = NULL, processed_at = NULL WHERE id = $3
                 RETURNING nextval('{retries}')"
            ),
            discard: format!(
                "UPDATE {t} SET state = 'processed', processed_at = $1, last_error = $2,
                   locked_by = NULL, locked_until = NULL WHERE id = $3"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selected_columns_are_the_outbox_columns() {
        let names = COLUMNS.replace("headers::text", "headers");
        assert_eq!(names, outbox_api::backend::OUTBOX_COLUMNS.join(", "));
    }

    #[test]
    fn names_are_checked_by_the_rules_of_every_store() {
        // The rules themselves are tested in outbox-api; here, that each
        // name is checked under its own field.
        let err = Names::new("public", "Orders", "inbox").unwrap_err();
        assert!(err.to_string().contains("`table`"), "{err}");
        let err = Names::new("public", "outbox", "pg_inbox").unwrap_err();
        assert!(err.to_string().contains("`inbox_table`"), "{err}");
        let err = Names::new("information_schema", "outbox", "inbox").unwrap_err();
        assert!(err.to_string().contains("`schema`"), "{err}");
        let err = Names::new("public", "same", "same").unwrap_err();
        assert!(err.to_string().contains("`inbox_table`"), "{err}");
    }

    #[test]
    fn lock_keys_and_channels_are_stable_and_distinct() {
        let a = Names::new("public", "outbox", "outbox_inbox").unwrap();
        let b = Names::new("shop", "outbox", "outbox_inbox").unwrap();
        assert_eq!(a.key_lock_seed(), a.clone().key_lock_seed());
        assert_ne!(a.key_lock_seed(), b.key_lock_seed());
        assert_eq!(a.channel(), "outbox.public.outbox");
        let long = Names::new(&"s".repeat(40), &"t".repeat(40), "i").unwrap();
        assert!(long.channel().len() <= 63, "{}", long.channel());
        // FNV-1a test vector: the keys must not change between releases.
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
