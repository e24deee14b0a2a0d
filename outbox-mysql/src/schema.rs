//! Table names, migrations and the SQL text built from them.
//!
//! Every table is InnoDB with `utf8mb4` and the binary collation
//! `utf8mb4_bin`, set explicitly: MySQL 8 and MariaDB default to different
//! (case-insensitive) collations, and a message type or key must compare
//! byte for byte on both. Keys and inbox consumers are `VARBINARY`, so
//! that trailing spaces count too (`utf8mb4_bin` pads).

use outbox_api::activity::{bucket_sql, latency_class_sql};
use outbox_api::backend::{OUTBOX_COLUMNS, validate_table_name};
use outbox_api::{Error, Result};

/// Default outbox table name.
pub const DEFAULT_OUTBOX_TABLE: &str = "outbox";
/// Default inbox table name.
pub const DEFAULT_INBOX_TABLE: &str = "outbox_inbox";
/// The table that records which migrations were applied to which table.
pub(crate) use outbox_api::backend::MIGRATIONS_TABLE as VERSIONS_TABLE;

/// How many per-key lock rows the outbox's key table holds: a key's
/// enqueues lock the row of its slot (`outbox_api::partition::of_key`).
pub const KEY_SLOTS: u16 = 1024;

/// The columns every message query returns, in the order of
/// [`OUTBOX_COLUMNS`] (`key` is a reserved word: quoted).
pub(crate) fn columns(prefix: &str) -> String {
    OUTBOX_COLUMNS
        .iter()
        .map(|c| format!("{prefix}`{c}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Migrations of the outbox table, in order; `{t}` is the table name.
const OUTBOX_MIGRATIONS: &[&str] = &[
    // 1: the table, its key-lock table and the indexes that keep claims,
    // counts and purges proportional to what they touch. MySQL has no
    // partial indexes: each index leads with `state`.
    "CREATE TABLE IF NOT EXISTS `{t}` (
        seq           BIGINT       NOT NULL AUTO_INCREMENT,
        id            BINARY(16)   NOT NULL,
        kind          VARCHAR(16)  NOT NULL,
        message_type  VARCHAR(255) NOT NULL,
        `key`         VARBINARY(255),
        exchange      VARCHAR(255),
        routing_key   VARCHAR(255),
        payload       LONGBLOB     NOT NULL,
        content_type  TEXT         NOT NULL,
        headers       MEDIUMTEXT,
        trace_parent  VARCHAR(64),
        created_at    BIGINT       NOT NULL,
        available_at  BIGINT       NOT NULL,
        attempts      INT          NOT NULL DEFAULT 0,
        last_error    MEDIUMTEXT,
        state         VARCHAR(16)  NOT NULL DEFAULT 'pending',
        locked_by     VARCHAR(1024),
        locked_until  BIGINT,
        processed_at  BIGINT,
        failed_at     BIGINT,
        PRIMARY KEY (seq),
        UNIQUE KEY id_idx (id),
        KEY state_seq_idx (state, seq),
        KEY key_seq_idx (`key`, seq),
        KEY processed_idx (state, processed_at)
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
    "CREATE TABLE IF NOT EXISTS `{t}_keys` (
        slot SMALLINT NOT NULL,
        PRIMARY KEY (slot)
    ) ENGINE=InnoDB",
    "{fill_keys}",
];

/// Migrations of the inbox table, in order; `{t}` is the table name.
const INBOX_MIGRATIONS: &[&str] = &[
    // 1: one row per (consumer, message) handled.
    "CREATE TABLE IF NOT EXISTS `{t}` (
        consumer     VARBINARY(512) NOT NULL,
        message_id   BINARY(16)     NOT NULL,
        received_at  BIGINT         NOT NULL,
        PRIMARY KEY (consumer, message_id),
        KEY received_idx (received_at)
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
];

/// Which migrations apply to a table.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TableKind {
    Outbox,
    Inbox,
}

impl TableKind {
    /// The statements of each version, in order: a version may be several
    /// statements (MySQL runs DDL one statement at a time).
    pub(crate) fn migrations(self) -> Vec<Vec<&'static str>> {
        match self {
            TableKind::Outbox => vec![OUTBOX_MIGRATIONS.to_vec()],
            TableKind::Inbox => vec![INBOX_MIGRATIONS.to_vec()],
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            TableKind::Outbox => "outbox",
            TableKind::Inbox => "inbox",
        }
    }

    /// `sql` for `table`.
    pub(crate) fn render(sql: &str, table: &str) -> String {
        if sql == "{fill_keys}" {
            let values = (0..KEY_SLOTS)
                .map(|s| format!("({s})"))
                .collect::<Vec<_>>()
                .join(",");
            return format!("INSERT IGNORE INTO `{table}_keys` (slot) VALUES {values}");
        }
        sql.replace("{t}", table)
    }
}

/// The validated names of one outbox + inbox pair.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub outbox: String,
    pub inbox: String,
}

impl Names {
    pub(crate) fn new(outbox: &str, inbox: &str) -> Result<Names> {
        validate_table_name("table", outbox)?;
        validate_table_name("inbox_table", inbox)?;
        if outbox == inbox {
            return Err(Error::config(
                "inbox_table",
                format!("the inbox table must differ from the outbox table `{outbox}`"),
            ));
        }
        if inbox == format!("{outbox}_keys") {
            return Err(Error::config(
                "inbox_table",
                format!("`{inbox}` is the key-lock table of the outbox table `{outbox}`"),
            ));
        }
        Ok(Names {
            outbox: outbox.to_owned(),
            inbox: inbox.to_owned(),
        })
    }
}

/// The SQL text of one outbox + inbox pair, built once from validated
/// names. `?` placeholders are bound in the order they appear.
#[derive(Debug)]
pub(crate) struct Sql {
    pub names: Names,
    /// `?` id, kind, message_type, key, exchange, routing_key, payload,
    /// content_type, headers, trace_parent, created_at, available_at —
    /// the head of a multi-row insert; one `ROW` per message follows.
    pub insert_head: String,
    /// `(?, …)`: one message's values.
    pub insert_row: &'static str,
    /// Locks key slots (`slot IN (…)` appended).
    pub lock_keys_head: String,
    /// The claim's locking read (see `claim.rs`); the limit follows.
    pub claim_select: String,
    /// Leases the locked rows (`seq IN (…)` appended).
    pub lease_head: String,
    pub poison_seq: String,
    pub unlock_seq: String,
    /// Completes (`id IN (…)` appended).
    pub complete_head: String,
    pub fail: String,
    pub fail_read: String,
    /// Releases (`id IN (…)` appended).
    pub release_head: String,
    pub release_worker: String,
    pub count_state: String,
    pub oldest_pending: String,
    pub max_seq: String,
    pub purge: String,
    pub list: String,
    pub get: String,
    pub state_of: String,
    pub retry: String,
    pub discard: String,
    /// The ids that exist already (`id IN (…)` appended).
    pub existing_head: String,
    /// Which of the watched ids are committed (`id IN (…)` appended).
    pub visible_head: String,
    pub receive: String,
    pub received: String,
    pub purge_inbox: String,
    pub activity_delivered: String,
    pub activity_failed: String,
    pub activity_created: String,
}

/// The rows an activity counts: pending or poisoned now, or processed since
/// the window's start `w.since`.
const COUNTED: &str =
    "(m.state IN ('pending', 'poisoned') OR (m.state = 'processed' AND m.processed_at >= w.since))";

impl Sql {
    pub(crate) fn new(names: Names) -> Sql {
        let t = format!("`{}`", names.outbox);
        let i = format!("`{}`", names.inbox);
        let cols = columns("");
        let m_cols = columns("m.");
        // The window's start and bucket, bound once, for the shared bucket
        // expression; `/` is decimal division in MySQL, so it is floored.
        let window = "(SELECT CAST(? AS SIGNED) AS since, CAST(? AS SIGNED) AS bucket) AS w";
        let bucket = |c: &str| {
            format!(
                "CAST(FLOOR({}) AS SIGNED)",
                bucket_sql(&format!("m.{c}"), "w.since", "w.bucket")
            )
        };
        Sql {
            insert_head: format!(
                "INSERT INTO {t} (id, kind, message_type, `key`, exchange, routing_key, payload, \
                 content_type, headers, trace_parent, created_at, available_at) VALUES "
            ),
            insert_row: "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            lock_keys_head: format!("SELECT slot FROM `{}_keys` WHERE slot IN ", names.outbox),
            claim_select: format!(
                "SELECT {m_cols},
                   (SELECT COUNT(*) FROM {t} AS e
                    WHERE e.`key` = m.`key` AND e.seq < m.seq AND e.state = 'pending') AS earlier
                 FROM {t} AS m
                 WHERE m.state = 'pending'
                   AND m.available_at <= ?
                   AND (m.locked_until IS NULL OR m.locked_until <= ?)
                   AND (? IS NULL OR m.kind = ?)
                   AND (m.`key` IS NULL OR (
                     NOT EXISTS (
                       SELECT 1 FROM {t} AS b
                       WHERE b.`key` = m.`key` AND b.seq < m.seq AND b.state <> 'processed'
                         AND (b.state <> 'pending'
                              OR b.available_at > ?
                              OR b.locked_until > ?
                              OR (? IS NOT NULL AND b.kind <> ?)))
                     AND NOT EXISTS (
                       SELECT 1 FROM {t} AS a
                       WHERE a.`key` = m.`key` AND a.seq > m.seq AND a.state = 'pending'
                         AND a.locked_until > ?)))
                 ORDER BY m.seq
                 LIMIT ?
                 FOR UPDATE SKIP LOCKED"
            ),
            lease_head: format!("UPDATE {t} SET locked_by = ?, locked_until = ? WHERE seq IN "),
            poison_seq: format!(
                "UPDATE {t} SET state = 'poisoned', last_error = ?, locked_by = NULL, \
                 locked_until = NULL, failed_at = ? WHERE seq = ?"
            ),
            unlock_seq: format!(
                "UPDATE {t} SET locked_by = NULL, locked_until = NULL WHERE seq = ?"
            ),
            complete_head: format!(
                "UPDATE {t} SET state = 'processed', processed_at = ?, locked_by = NULL, \
                 locked_until = NULL WHERE state = 'pending' AND id IN "
            ),
            // `state` and `available_at` are assigned before `attempts`:
            // MySQL (and MariaDB without SIMULTANEOUS_ASSIGNMENT) let a later
            // assignment see an earlier one's new value; in this order both
            // read the old `attempts` either way.
            fail: format!(
                "UPDATE {t} SET
                   state = CASE WHEN attempts + 1 >= ? THEN 'poisoned' ELSE 'pending' END,
                   available_at = CASE WHEN attempts + 1 >= ? THEN available_at ELSE ? END,
                   attempts = attempts + 1, last_error = ?,
                   locked_by = NULL, locked_until = NULL, failed_at = ?
                 WHERE id = ? AND state = 'pending' AND locked_by = ?"
            ),
            fail_read: format!("SELECT attempts, state FROM {t} WHERE id = ?"),
            release_head: format!(
                "UPDATE {t} SET locked_by = NULL, locked_until = NULL, available_at = ?,
                   last_error = COALESCE(?, last_error)
                 WHERE state = 'pending' AND locked_by = ? AND id IN "
            ),
            release_worker: format!(
                "UPDATE {t} SET locked_by = NULL, locked_until = NULL
                 WHERE state = 'pending' AND locked_by = ?"
            ),
            count_state: format!("SELECT COUNT(*) FROM {t} WHERE state = ?"),
            oldest_pending: format!(
                "SELECT created_at FROM {t} WHERE state = 'pending' ORDER BY seq LIMIT 1"
            ),
            max_seq: format!("SELECT COALESCE(MAX(seq), 0) FROM {t}"),
            purge: format!(
                "DELETE FROM {t} WHERE state = 'processed' AND processed_at < ? \
                 ORDER BY processed_at LIMIT ?"
            ),
            list: format!(
                "SELECT {cols} FROM {t}
                 WHERE (? IS NULL OR state = ?) AND (? IS NULL OR message_type = ?)
                   AND (? IS NULL OR SUBSTRING(trace_parent, 4, 32) = ?)
                 ORDER BY seq LIMIT ? OFFSET ?"
            ),
            get: format!("SELECT {cols} FROM {t} WHERE id = ?"),
            state_of: format!("SELECT state, last_error FROM {t} WHERE id = ? FOR UPDATE"),
            retry: format!(
                "UPDATE {t} SET state = 'pending', attempts = 0, available_at = ?, last_error = ?,
                   locked_by = NULL, locked_until = NULL WHERE id = ?"
            ),
            discard: format!(
                "UPDATE {t} SET state = 'processed', processed_at = ?, last_error = ?,
                   locked_by = NULL, locked_until = NULL WHERE id = ?"
            ),
            existing_head: format!("SELECT id FROM {t} WHERE id IN "),
            visible_head: format!("SELECT id FROM {t} WHERE id IN "),
            receive: format!(
                "INSERT INTO {i} (consumer, message_id, received_at) VALUES (?, ?, ?)"
            ),
            received: format!("SELECT 1 FROM {i} WHERE consumer = ? AND message_id = ?"),
            purge_inbox: format!(
                "DELETE FROM {i} WHERE received_at < ? ORDER BY received_at LIMIT ?"
            ),
            activity_delivered: format!(
                "SELECT {}, CAST({} AS SIGNED), COUNT(*) FROM {t} AS m, {window} \
                 WHERE m.state = 'processed' AND m.processed_at >= w.since GROUP BY 1, 2",
                bucket("processed_at"),
                latency_class_sql("(m.processed_at - m.created_at)")
            ),
            activity_failed: format!(
                "SELECT {}, m.state, COUNT(*) FROM {t} AS m, {window} \
                 WHERE m.failed_at >= w.since AND {COUNTED} GROUP BY 1, 2",
                bucket("failed_at")
            ),
            activity_created: format!(
                "SELECT {}, COUNT(*) FROM {t} AS m, {window} WHERE {COUNTED} GROUP BY 1",
                bucket("created_at")
            ),
            names,
        }
    }
}

/// `(?, ?, …)` with `n` placeholders (at least one).
pub(crate) fn placeholders(n: usize) -> String {
    let mut s = String::with_capacity(2 + 3 * n);
    s.push('(');
    for i in 0..n.max(1) {
        if i > 0 {
            s.push_str(", ");
        }
        s.push('?');
    }
    s.push(')');
    s
}

/// The size an id list of `n` is padded to (repeating its last id): a power
/// of two, so that the statements of many list lengths are few prepared
/// statements.
pub(crate) fn padded_len(n: usize) -> usize {
    n.max(1).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selected_columns_are_the_outbox_columns_quoted() {
        assert!(columns("").starts_with("`seq`, `id`, `kind`"));
        assert!(columns("m.").contains("m.`key`"));
        assert_eq!(columns("").matches('`').count(), 2 * OUTBOX_COLUMNS.len());
    }

    #[test]
    fn names_are_validated_by_the_shared_rules() {
        assert!(Names::new("outbox", "outbox_inbox").is_ok());
        for (t, i) in [
            ("x; DROP TABLE y", "inbox"),
            ("Outbox", "i"),
            ("o", "o"),
            ("o", "o_keys"),
        ] {
            let e = Names::new(t, i).unwrap_err();
            assert_eq!(e.kind(), outbox_api::ErrorKind::Config, "{t}/{i}: {e}");
        }
    }

    #[test]
    fn id_lists_pad_to_powers_of_two() {
        assert_eq!(placeholders(3), "(?, ?, ?)");
        assert_eq!([1, 2, 3, 5, 64, 65].map(padded_len), [1, 2, 4, 8, 64, 128]);
    }
}
