//! The fault tests on MySQL/MariaDB: the receiver, enqueueing through a
//! database that may go away mid-transaction, and reading what was
//! delivered — as [`postgres`](crate::postgres) does on PostgreSQL, on
//! tables named `<prefix>_…` in one database (MySQL has no schemas).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{Dispatcher, ErrorKind, HandlerError, Message, Timestamp};
use outbox_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use outbox_mysql::sqlx::{self, AssertSqlSafe, Row};
use outbox_mysql::{MySqlOutbox, MySqlStore, error_kind};

use crate::check::{self, Counts, EffectRow, Expected, Report};
use crate::tally::{Failed, Tally};
use crate::writer::{self, BatchFailed, Enqueued};

/// The test's outbox table: `<prefix>_outbox`.
pub fn outbox_table(prefix: &str) -> String {
    format!("{prefix}_outbox")
}

/// A pool on `url` that connects lazily (so that it can be made while the
/// server is down), checks a connection before handing it out, and gives up
/// waiting for one after `acquire_timeout` — within the relay's handler
/// timeout, as [`postgres::lazy_pool`](crate::postgres::lazy_pool) explains.
pub fn lazy_pool(
    url: &str,
    max_connections: u32,
    acquire_timeout: Duration,
) -> Result<MySqlPool, String> {
    let options: MySqlConnectOptions = url
        .parse()
        .map_err(|e| format!("the MySQL URL is not valid: {e}"))?;
    Ok(MySqlPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .connect_lazy_with(options))
}

/// Whether a sqlx error says the database was (briefly) out of reach.
fn unavailable(e: &sqlx::Error) -> bool {
    error_kind(e) == ErrorKind::Unavailable
}

/// Creates the receiver's tables `<prefix>_effects` (its `id` is the order
/// effects were committed), `<prefix>_calls`, `<prefix>_counters` and the
/// receiver's inbox, as [`postgres::prepare_receiver`](crate::postgres::prepare_receiver)
/// does in a schema.
pub async fn prepare_receiver(pool: &MySqlPool, url: &str, prefix: &str) -> Result<(), String> {
    let ddl = [
        format!(
            "CREATE TABLE IF NOT EXISTS `{prefix}_effects` (
                 id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(64) NOT NULL,
                 `key` VARCHAR(200) NULL, seq BIGINT NOT NULL, worker VARCHAR(100) NOT NULL,
                 at_ms BIGINT NOT NULL) ENGINE = InnoDB"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS `{prefix}_calls` (
                 id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(64) NOT NULL,
                 worker VARCHAR(100) NOT NULL, duplicate BOOLEAN NOT NULL,
                 at_ms BIGINT NOT NULL) ENGINE = InnoDB"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS `{prefix}_counters` (
                 name VARCHAR(100) PRIMARY KEY, value BIGINT NOT NULL) ENGINE = InnoDB"
        ),
    ];
    for statement in ddl {
        sqlx::query(AssertSqlSafe(statement))
            .execute(pool)
            .await
            .map_err(|e| format!("creating the receiver tables: {e}"))?;
    }
    receiver_inbox(url, prefix)
        .await?
        .migrate()
        .await
        .map_err(|e| format!("creating the receiver inbox: {e}"))
}

async fn receiver_inbox(url: &str, prefix: &str) -> Result<MySqlStore, String> {
    MySqlStore::builder(url)
        .table(format!("{prefix}_rx_outbox"))
        .inbox_table(format!("{prefix}_rx_inbox"))
        .max_connections(2)
        .connect()
        .await
        .map_err(|e| format!("opening the receiver inbox: {e}"))
}

/// The domain handler of the fault tests on MySQL, as
/// [`PgReceiver`](crate::postgres::PgReceiver) on PostgreSQL: for each
/// message, in ONE transaction, the inbox entry
/// ([`MySqlOutbox::try_receive`]), then its effect row if it is new or a
/// bump of this worker's `duplicates` counter if not, and a `calls` row.
/// Out of reach (the server killed), it returns `TemporarilyUnavailable`.
#[derive(Clone)]
pub struct MySqlReceiver {
    shared: Arc<Shared>,
}

struct Shared {
    pool: MySqlPool,
    inbox: MySqlOutbox,
    consumer: String,
    worker: String,
    insert_effect: String,
    bump_duplicates: String,
    insert_call: String,
    tally: Tally,
}

impl std::fmt::Debug for MySqlReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlReceiver")
            .field("consumer", &self.shared.consumer)
            .field("worker", &self.shared.worker)
            .finish_non_exhaustive()
    }
}

impl MySqlReceiver {
    /// A receiver on the tables [`prepare_receiver`] made, its inbox opened
    /// from `url`, its transactions on `pool`.
    pub async fn open(
        pool: MySqlPool,
        url: &str,
        prefix: &str,
        consumer: &str,
        worker: &str,
    ) -> Result<MySqlReceiver, String> {
        let inbox = receiver_inbox(url, prefix).await?.outbox();
        Ok(MySqlReceiver {
            shared: Arc::new(Shared {
                pool,
                inbox,
                consumer: consumer.to_owned(),
                worker: worker.to_owned(),
                insert_effect: format!(
                    "INSERT INTO `{prefix}_effects` (message_id, `key`, seq, worker, at_ms)
                     VALUES (?, ?, ?, ?, ?)"
                ),
                // One counter row per worker: relays never wait on each
                // other's counter.
                bump_duplicates: format!(
                    "INSERT INTO `{prefix}_counters` (name, value) VALUES (?, 1)
                     ON DUPLICATE KEY UPDATE value = value + 1"
                ),
                insert_call: format!(
                    "INSERT INTO `{prefix}_calls` (message_id, worker, duplicate, at_ms)
                     VALUES (?, ?, ?, ?)"
                ),
                tally: Tally::default(),
            }),
        })
    }

    /// Handled, duplicates and failures, for the child's last line.
    pub fn figures(&self) -> (u64, u64, usize) {
        let t = &self.shared.tally;
        (t.handled(), t.duplicates(), t.errors().len())
    }
}

impl Shared {
    /// The receiver transaction; returns whether the message was new.
    async fn record(&self, m: &Message) -> Result<bool, Failed> {
        let seq: i64 = std::str::from_utf8(&m.payload)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Failed::Other(format!("payload of {} is not a number", m.id)))?;
        let id = m.id.to_string();
        let now = Timestamp::now().as_millis();
        let step = |what: &'static str| {
            move |e: sqlx::Error| {
                let text = format!("{what}: {e}");
                if unavailable(&e) {
                    Failed::Unavailable(text)
                } else {
                    Failed::Other(text)
                }
            }
        };
        let mut tx = self.pool.begin().await.map_err(step("BEGIN"))?;
        let new = self
            .inbox
            .try_receive(&mut tx, &self.consumer, m.id)
            .await
            .map_err(|e| {
                let text = format!("try_receive: {e}");
                if e.kind() == ErrorKind::Unavailable {
                    Failed::Unavailable(text)
                } else {
                    Failed::Other(text)
                }
            })?;
        if new {
            sqlx::query(AssertSqlSafe(self.insert_effect.as_str()))
                .bind(&id)
                .bind(m.key.as_deref())
                .bind(seq)
                .bind(&self.worker)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(step("INSERT INTO effects"))?;
        } else {
            sqlx::query(AssertSqlSafe(self.bump_duplicates.as_str()))
                .bind(format!("duplicates/{}", self.worker))
                .execute(&mut *tx)
                .await
                .map_err(step("UPDATE counters"))?;
        }
        sqlx::query(AssertSqlSafe(self.insert_call.as_str()))
            .bind(&id)
            .bind(&self.worker)
            .bind(!new)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(step("INSERT INTO calls"))?;
        tx.commit().await.map_err(step("COMMIT"))?;
        Ok(new)
    }
}

#[async_trait]
impl Dispatcher for MySqlReceiver {
    async fn dispatch(&self, message: &Message) -> Result<(), HandlerError> {
        let outcome = self.shared.record(message).await;
        self.shared
            .tally
            .answer(&self.shared.worker, message.id, outcome)
    }
}

/// Enqueues `count` messages through `outbox` on `pool` in transactions of
/// 1–8 messages (the shared writer loop: retried when rolled back by an
/// outage, uncertain when the `COMMIT` got no answer; see [`settle`]).
pub async fn enqueue_many(
    outbox: &MySqlOutbox,
    pool: &MySqlPool,
    rng: &mut fastrand::Rng,
    first_seq: i64,
    count: usize,
    keys: usize,
    key_prefix: &str,
) -> Result<Enqueued, String> {
    writer::enqueue_many(rng, first_seq, count, keys, key_prefix, |batch| {
        enqueue_batch(outbox, pool, batch)
    })
    .await
}

async fn enqueue_batch(
    outbox: &MySqlOutbox,
    pool: &MySqlPool,
    batch: Vec<(i64, Option<String>)>,
) -> Result<Vec<Expected>, BatchFailed> {
    let fail = |e: sqlx::Error, what: &str| {
        if unavailable(&e) {
            BatchFailed::Unavailable
        } else {
            BatchFailed::Other(format!("{what}: {e}"))
        }
    };
    let mut tx = pool.begin().await.map_err(|e| fail(e, "BEGIN"))?;
    let mut done = Vec::with_capacity(batch.len());
    for (seq, key) in batch {
        match outbox
            .enqueue(&mut tx, check::message(seq, key.as_deref()))
            .await
        {
            Ok(id) => done.push(Expected { id, seq, key }),
            Err(e) if e.kind() == ErrorKind::Unavailable => return Err(BatchFailed::Unavailable),
            Err(e) => return Err(BatchFailed::Other(format!("enqueue: {e}"))),
        }
    }
    match tx.commit().await {
        Ok(()) => Ok(done),
        Err(e) if unavailable(&e) => Err(BatchFailed::Commit(done)),
        Err(e) => Err(BatchFailed::Other(format!("COMMIT: {e}"))),
    }
}

/// The messages that were enqueued: the committed ones and each uncertain
/// batch whose rows are in the outbox `<prefix>_outbox`
/// ([`Enqueued::settle_with`]).
pub async fn settle(
    enqueued: Enqueued,
    pool: &MySqlPool,
    prefix: &str,
) -> Result<Vec<Expected>, String> {
    let table = outbox_table(prefix);
    let mut present = HashSet::new();
    for batch in &enqueued.uncertain {
        for e in batch {
            let there: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT 1 FROM `{table}` WHERE id = ?"
            )))
            .bind(e.id.as_uuid())
            .fetch_optional(pool)
            .await
            .map_err(|e| format!("looking up uncertain batches: {e}"))?;
            if there.is_some() {
                present.insert(e.id);
            }
        }
    }
    enqueued.settle_with(&present)
}

/// One count, `None` while the database is out of reach.
pub async fn count(pool: &MySqlPool, sql: &str) -> Option<u64> {
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .ok()
        .map(|n| n as u64)
}

/// The test's outbox rows in `state` (`None` while out of reach).
pub async fn in_state(pool: &MySqlPool, prefix: &str, state: &str) -> Option<u64> {
    let table = outbox_table(prefix);
    count(
        pool,
        &format!("SELECT CAST(COUNT(*) AS SIGNED) FROM `{table}` WHERE state = '{state}'"),
    )
    .await
}

/// The test's outbox rows that still carry a lease: after every relay
/// stopped gracefully there must be none.
pub async fn leased(pool: &MySqlPool, prefix: &str) -> Option<u64> {
    let table = outbox_table(prefix);
    count(
        pool,
        &format!("SELECT CAST(COUNT(*) AS SIGNED) FROM `{table}` WHERE locked_by IS NOT NULL"),
    )
    .await
}

/// Compares what the receiver recorded in the `<prefix>_…` tables with
/// `expected`.
pub async fn verify(pool: &MySqlPool, prefix: &str, expected: &[Expected]) -> Report {
    let q = |sql: String| async move {
        count(pool, &sql)
            .await
            .unwrap_or_else(|| panic!("reading `{sql}` failed"))
    };
    let (p, t) = (prefix, outbox_table(prefix));
    let counts = Counts {
        effects: q(format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM `{p}_effects`"
        ))
        .await,
        duplicates: q(format!(
            "SELECT CAST(COALESCE(SUM(value), 0) AS SIGNED) FROM `{p}_counters`
             WHERE name LIKE 'duplicates/%'"
        ))
        .await,
        calls: q(format!("SELECT CAST(COUNT(*) AS SIGNED) FROM `{p}_calls`")).await,
        duplicate_calls: q(format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM `{p}_calls` WHERE duplicate"
        ))
        .await,
        not_processed: q(format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM `{t}` WHERE state <> 'processed'"
        ))
        .await,
        attempts_nonzero: q(format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM `{t}` WHERE attempts <> 0"
        ))
        .await,
    };
    let rows: Vec<EffectRow> = sqlx::query(AssertSqlSafe(format!(
        "SELECT message_id, `key`, seq, worker FROM `{p}_effects` ORDER BY id"
    )))
    .fetch_all(pool)
    .await
    .expect("reading the effects")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect();
    Report::compare(expected, counts, rows)
}

/// What a relay logs because its MySQL server was out of reach — each is
/// expected while the server is killed and started again.
pub const OUTAGE_LINES: &[&str] = &[
    // The store's errors of kind Unavailable (CountingStore).
    "[Unavailable]",
    // The relay on a store call that failed so: retried, or left to the lease.
    "error=unavailable",
    // The handler said so (MySqlReceiver), retried uncounted.
    "HANDLER_UNAVAILABLE",
    "handler temporarily unavailable; tried again later, not counted",
    // sqlx finding a pooled connection dead, or a statement that waited.
    "error occurred while testing the connection",
    "slow statement: execution time exceeded alert threshold",
    "time to acquire exceeded slow threshold",
];

/// The problem lines in a child's log that the MySQL server's outage does
/// not explain ([`check::log_problems_beyond`] with [`OUTAGE_LINES`]).
pub fn log_problems_beyond_outages(log: &std::path::Path) -> Vec<String> {
    check::log_problems_beyond(log, OUTAGE_LINES)
}
