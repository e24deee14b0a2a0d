//! Table names, migrations and the SQL text built from them.

use outbox_api::activity::ActivitySql;
use outbox_api::{Error, Result};

/// Default outbox table name.
pub const DEFAULT_OUTBOX_TABLE: &str = "outbox";
/// Default inbox table name.
pub const DEFAULT_INBOX_TABLE: &str = "outbox_inbox";
/// The table that records which migrations were applied to which table.
pub(crate) use outbox_api::backend::MIGRATIONS_TABLE as VERSIONS_TABLE;
/// The table-name rules of every store.
pub(crate) use outbox_api::backend::validate_table_name;

/// The columns every message query returns, in the order `decode_row` reads them.
pub(crate) const COLUMNS: &str = "seq, id, kind, message_type, key, exchange, routing_key, payload, \
     content_type, headers, trace_parent, created_at, available_at, attempts, last_error, state, \
     locked_by, locked_until, processed_at";

/// Migrations of the outbox table, in order; `{t}` is the table name.
const OUTBOX_MIGRATIONS: &[&str] = &[
    // 1: the table and the indexes that keep claims proportional to the batch.
    // `seq` is the rowid: SQLite gives each insert max(rowid)+1 under its
    // single writer, so it is commit order; no AUTOINCREMENT, whose
    // sqlite_sequence update would cost every enqueue one more page write.
    // Keyless messages stay out of the key index for the same reason.
    "CREATE TABLE IF NOT EXISTS {t} (
        seq           INTEGER PRIMARY KEY,
        id            TEXT    NOT NULL UNIQUE,
        kind          TEXT    NOT NULL,
        message_type  TEXT    NOT NULL,
        key           TEXT,
        exchange      TEXT,
        routing_key   TEXT,
        payload       BLOB    NOT NULL,
        content_type  TEXT    NOT NULL,
        headers       TEXT,
        trace_parent  TEXT,
        created_at    INTEGER NOT NULL,
        available_at  INTEGER NOT NULL,
        attempts      INTEGER NOT NULL DEFAULT 0,
        last_error    TEXT,
        state         TEXT    NOT NULL DEFAULT 'pending',
        locked_by     TEXT,
        locked_until  INTEGER,
        processed_at  INTEGER
    );
    CREATE INDEX IF NOT EXISTS {t}_pending_idx ON {t} (seq) WHERE state = 'pending';
    CREATE INDEX IF NOT EXISTS {t}_poisoned_idx ON {t} (seq) WHERE state = 'poisoned';
    CREATE INDEX IF NOT EXISTS {t}_key_idx ON {t} (key, seq) WHERE key IS NOT NULL AND state <> 'processed';
    CREATE INDEX IF NOT EXISTS {t}_processed_idx ON {t} (processed_at) WHERE state = 'processed';",
    // 2: when a message last failed (`Store::fail`, or poisoned as a
    // corrupt row), for the console's activity charts (outbox_api::activity).
    "ALTER TABLE {t} ADD COLUMN failed_at INTEGER;",
];

/// Migrations of the inbox table, in order; `{t}` is the table name.
const INBOX_MIGRATIONS: &[&str] = &[
    // 1: one row per (consumer, message) handled.
    "CREATE TABLE IF NOT EXISTS {t} (
        consumer     TEXT    NOT NULL,
        message_id   TEXT    NOT NULL,
        received_at  INTEGER NOT NULL,
        UNIQUE (consumer, message_id)
    );
    CREATE INDEX IF NOT EXISTS {t}_received_idx ON {t} (received_at);",
];

/// Which migrations apply to a table.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TableKind {
    Outbox,
    Inbox,
}

impl TableKind {
    fn migrations(self) -> &'static [&'static str] {
        match self {
            TableKind::Outbox => OUTBOX_MIGRATIONS,
            TableKind::Inbox => INBOX_MIGRATIONS,
        }
    }
    fn label(self) -> &'static str {
        match self {
            TableKind::Outbox => "outbox",
            TableKind::Inbox => "inbox",
        }
    }
}

/// Applies the missing migrations of `table` inside `tx` (an IMMEDIATE
/// transaction); returns how many were applied.
pub(crate) fn migrate_table(
    tx: &rusqlite::Transaction<'_>,
    kind: TableKind,
    table: &str,
    now_millis: i64,
) -> rusqlite::Result<usize> {
    tx.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {VERSIONS_TABLE} (
            table_name  TEXT PRIMARY KEY,
            table_kind  TEXT NOT NULL,
            version     INTEGER NOT NULL,
            applied_at  INTEGER NOT NULL
        )"
    ))?;
    let current: i64 = tx
        .query_row(
            &format!("SELECT version FROM {VERSIONS_TABLE} WHERE table_name = ?1"),
            [table],
            |r| r.get(0),
        )
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(0),
            e => Err(e),
        })?;
    let migrations = kind.migrations();
    let mut applied = 0;
    for (i, sql) in migrations.iter().enumerate() {
        let version = i as i64 + 1;
        if version <= current {
            continue;
        }
        tx.execute_batch(&sql.replace("{t}", table))?;
        applied += 1;
    }
    if applied > 0 {
        tx.execute(
            &format!(
                "INSERT INTO {VERSIONS_TABLE} (table_name, table_kind, version, applied_at)
                 VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (table_name) DO UPDATE SET version = excluded.version, applied_at = excluded.applied_at"
            ),
            rusqlite::params![table, kind.label(), migrations.len() as i64, now_millis],
        )?;
    }
    Ok(applied)
}

/// The SQL text of one outbox + inbox pair, built once from validated names.
#[derive(Debug)]
pub(crate) struct Sql {
    pub outbox: String,
    pub inbox: String,
    pub insert: String,
    pub receive: String,
    pub purge_inbox: String,
    pub poison_seq: String,
    pub unlock_seq: String,
    pub complete: String,
    pub fail: String,
    pub release: String,
    pub release_worker: String,
    /// The console's activity counts (`outbox_api::activity`).
    pub activity: ActivitySql,
}

impl Sql {
    pub(crate) fn new(outbox: &str, inbox: &str) -> Result<Sql> {
        validate_table_name("table", outbox)?;
        validate_table_name("inbox_table", inbox)?;
        if outbox == inbox {
            return Err(Error::config(
                "inbox_table",
                format!("the inbox table must differ from the outbox table `{outbox}`"),
            ));
        }
        Ok(Sql {
            activity: ActivitySql::new(outbox),
            outbox: outbox.to_owned(),
            inbox: inbox.to_owned(),
            insert: format!(
                "INSERT INTO {outbox} (id, kind, message_type, key, exchange, routing_key, payload, \
                 content_type, headers, trace_parent, created_at, available_at, attempts, state) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 0, 'pending')"
            ),
            receive: format!(
                "INSERT OR IGNORE INTO {inbox} (consumer, message_id, received_at) VALUES (?1, ?2, ?3)"
            ),
            purge_inbox: format!(
                "DELETE FROM {inbox} WHERE rowid IN \
                 (SELECT rowid FROM {inbox} WHERE received_at < ?1 LIMIT ?2)"
            ),
            poison_seq: format!(
                "UPDATE {outbox} SET state = 'poisoned', last_error = ?1, locked_by = NULL, \
                 locked_until = NULL, failed_at = ?3 WHERE seq = ?2"
            ),
            unlock_seq: format!(
                "UPDATE {outbox} SET locked_by = NULL, locked_until = NULL WHERE seq = ?1"
            ),
            complete: format!(
                "UPDATE {outbox} SET state = 'processed', processed_at = ?1, locked_by = NULL, \
                 locked_until = NULL WHERE id = ?2 AND state = 'pending'"
            ),
            fail: format!(
                "UPDATE {outbox} SET attempts = attempts + 1, last_error = ?1,
                   state = CASE WHEN attempts + 1 >= ?2 THEN 'poisoned' ELSE 'pending' END,
                   available_at = CASE WHEN attempts + 1 >= ?2 THEN available_at ELSE ?3 END,
                   locked_by = NULL, locked_until = NULL, failed_at = ?6
                 WHERE id = ?4 AND state = 'pending' AND locked_by = ?5
                 RETURNING attempts, state"
            ),
            release: format!(
                "UPDATE {outbox} SET locked_by = NULL, locked_until = NULL, available_at = ?1,
                   last_error = COALESCE(?2, last_error)
                 WHERE id = ?3 AND state = 'pending' AND locked_by = ?4"
            ),
            release_worker: format!(
                "UPDATE {outbox} SET locked_by = NULL, locked_until = NULL
                 WHERE state = 'pending' AND locked_by = ?1"
            ),
        })
    }
}

impl Sql {
    /// The claim statement for batches of `limit`; see [`claim_sql`].
    pub(crate) fn claim(&self, limit: usize) -> String {
        claim_sql(&self.outbox, limit)
    }
}

/// The claim statement (`?1` worker, `?2` locked_until, `?3` now, `?4` kind
/// or NULL).
///
/// The limit is written into the text, not bound: SQLite re-prepares an
/// `UPDATE … WHERE seq IN (SELECT … LIMIT ?)` on every execution (one
/// re-prepare per call; the bench figure "drain N to an in-process handler,
/// SQLite, batch 20" shows its cost), but caches a statement with a literal
/// limit. A relay claims with one limit. See
/// `docs/decisions.md#the-claims-limit-is-written-into-the-sql`.
pub(crate) fn claim_sql(t: &str, limit: usize) -> String {
    // Claimable: pending, available, lease free, kind matches, and no earlier
    // message of the same key that is poisoned or pending-but-not-claimable
    // (those earlier ones that are claimable come first in seq order, so they
    // are claimed by this same statement).
    format!(
        "UPDATE {t} SET locked_by = ?1, locked_until = ?2
         WHERE seq IN (
           SELECT m.seq FROM {t} AS m
           WHERE m.state = 'pending'
             AND m.available_at <= ?3
             AND (m.locked_until IS NULL OR m.locked_until <= ?3)
             AND (?4 IS NULL OR m.kind = ?4)
             AND (m.key IS NULL OR NOT EXISTS (
               SELECT 1 FROM {t} AS b
               WHERE b.key = m.key AND b.seq < m.seq AND b.state <> 'processed'
                 AND (b.state <> 'pending'
                      OR b.available_at > ?3
                      OR (b.locked_until IS NOT NULL AND b.locked_until > ?3)
                      OR (?4 IS NOT NULL AND b.kind <> ?4))))
           ORDER BY m.seq
           LIMIT {limit})
         RETURNING {COLUMNS}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selected_columns_are_the_outbox_columns() {
        assert_eq!(COLUMNS, outbox_api::backend::OUTBOX_COLUMNS.join(", "));
    }
}
