//! The fault tests on PostgreSQL: the receiver, enqueueing through a
//! database that may go away mid-transaction, reading what was delivered,
//! and the disruptions themselves (`pg_terminate_backend`, a restart).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_api::{Dispatcher, ErrorKind, HandlerError, Message, MessageId, Timestamp};
use outbox_postgres::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use outbox_postgres::sqlx::{self, AssertSqlSafe, Row};
use outbox_postgres::{PgOutbox, PgStore, WakeUp, error_kind};

use crate::check::{self, Counts, EffectRow, Expected, Report};
use crate::tally::{Failed, Tally};
pub use crate::writer::Enqueued;
use crate::writer::{self, BatchFailed};
use crate::{RECEIVER_INBOX_TABLE, RECEIVER_OUTBOX_TABLE};

/// The outbox table's name in the test's schema.
pub const OUTBOX_TABLE: &str = "outbox";

/// `url` with `application_name` set to `name`, so that a test can find
/// (and end) the connections of one process in `pg_stat_activity`.
pub fn with_application_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

/// A pool on `url` that connects lazily (so that it can be made while the
/// server restarts), checks a connection before handing it out, and gives
/// up waiting for one after `acquire_timeout`.
///
/// A handler's pool must give up well within the relay's
/// `handler_timeout`: then a database outage surfaces as an error the
/// handler turns into [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable) (retried, not counted),
/// where a handler still waiting at its timeout counts an attempt.
pub fn lazy_pool(
    url: &str,
    max_connections: u32,
    acquire_timeout: Duration,
) -> Result<PgPool, String> {
    let options: PgConnectOptions = url
        .parse()
        .map_err(|e| format!("the PostgreSQL URL is not valid: {e}"))?;
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .connect_lazy_with(options))
}

/// Whether a sqlx error says the database was (briefly) out of reach.
fn unavailable(e: &sqlx::Error) -> bool {
    error_kind(e) == ErrorKind::Unavailable
}

/// Creates the receiver's tables in `schema` (which must exist), like
/// [`prepare_receiver_schema`](crate::prepare_receiver_schema) on SQLite:
/// `effects` (its `id` is the order effects were written; a key's next
/// message starts only after the previous one's effect committed),
/// `calls`, `counters` (`duplicates/<worker>`: one row per worker), and
/// the receiver's inbox table.
pub async fn prepare_receiver(pool: &PgPool, schema: &str) -> Result<(), String> {
    let ddl = format!(
        r#"CREATE TABLE IF NOT EXISTS "{schema}".effects (
               id bigserial PRIMARY KEY, message_id text NOT NULL, key text,
               seq bigint NOT NULL, worker text NOT NULL, at_ms bigint NOT NULL);
           CREATE TABLE IF NOT EXISTS "{schema}".calls (
               id bigserial PRIMARY KEY, message_id text NOT NULL, worker text NOT NULL,
               duplicate boolean NOT NULL, at_ms bigint NOT NULL);
           CREATE TABLE IF NOT EXISTS "{schema}".counters (
               name text PRIMARY KEY, value bigint NOT NULL);"#
    );
    sqlx::raw_sql(AssertSqlSafe(ddl))
        .execute(pool)
        .await
        .map_err(|e| format!("creating the receiver tables: {e}"))?;
    receiver_inbox(pool, schema)
        .await?
        .migrate()
        .await
        .map_err(|e| format!("creating the receiver inbox: {e}"))
}

async fn receiver_inbox(pool: &PgPool, schema: &str) -> Result<PgStore, String> {
    PgStore::builder_with_pool(pool.clone())
        .schema(schema)
        .table(RECEIVER_OUTBOX_TABLE)
        .inbox_table(RECEIVER_INBOX_TABLE)
        .wake_up(WakeUp::PollOnly)
        .connect()
        .await
        .map_err(|e| format!("opening the receiver inbox: {e}"))
}

/// The domain handler of the fault tests on PostgreSQL.
///
/// For each message, in ONE transaction: records it in the inbox
/// ([`PgOutbox::try_receive`]), then inserts its effect row if it is new or
/// bumps the `duplicates` counter if not, inserts a `calls` row, commits.
/// When its database is out of reach (a terminated connection, a restart)
/// it returns [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable), which the relay retries without
/// counting an attempt, and prints a `HANDLER_UNAVAILABLE` line; any other
/// failure prints a `HANDLER_ERROR` line.
#[derive(Clone)]
pub struct PgReceiver {
    shared: Arc<Shared>,
}

struct Shared {
    pool: PgPool,
    inbox: PgOutbox,
    consumer: String,
    worker: String,
    delay: Duration,
    insert_effect: String,
    bump_duplicates: String,
    insert_call: String,
    tally: Tally,
}

impl std::fmt::Debug for PgReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgReceiver")
            .field("consumer", &self.shared.consumer)
            .field("worker", &self.shared.worker)
            .finish_non_exhaustive()
    }
}

impl PgReceiver {
    /// A receiver on the tables [`prepare_receiver`] made in `schema`.
    pub async fn open(
        pool: PgPool,
        schema: &str,
        consumer: &str,
        worker: &str,
        delay: Duration,
    ) -> Result<PgReceiver, String> {
        let inbox = receiver_inbox(&pool, schema).await?.outbox();
        Ok(PgReceiver {
            shared: Arc::new(Shared {
                pool,
                inbox,
                consumer: consumer.to_owned(),
                worker: worker.to_owned(),
                delay,
                insert_effect: format!(
                    r#"INSERT INTO "{schema}".effects (message_id, key, seq, worker, at_ms)
                       VALUES ($1, $2, $3, $4, $5)"#
                ),
                // One counter row per worker: relays never wait on each
                // other's counter.
                bump_duplicates: format!(
                    r#"INSERT INTO "{schema}".counters (name, value) VALUES ($1, 1)
                       ON CONFLICT (name) DO UPDATE SET value = counters.value + 1"#
                ),
                insert_call: format!(
                    r#"INSERT INTO "{schema}".calls (message_id, worker, duplicate, at_ms)
                       VALUES ($1, $2, $3, $4)"#
                ),
                tally: Tally::default(),
            }),
        })
    }

    /// Messages handled for the first time by this receiver.
    pub fn handled(&self) -> u64 {
        self.shared.tally.handled()
    }

    /// Handled, duplicates and failures, for the child's last line.
    pub fn figures(&self) -> (u64, u64, usize) {
        (self.handled(), self.duplicates(), self.errors().len())
    }

    /// Duplicates this receiver's inbox turned away.
    pub fn duplicates(&self) -> u64 {
        self.shared.tally.duplicates()
    }

    /// Every handler failure so far other than the database being out of
    /// reach, naming the statement.
    pub fn errors(&self) -> Vec<String> {
        self.shared.tally.errors()
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
impl Dispatcher for PgReceiver {
    async fn dispatch(&self, message: &Message) -> Result<(), HandlerError> {
        if !self.shared.delay.is_zero() {
            tokio::time::sleep(self.shared.delay).await;
        }
        let outcome = self.shared.record(message).await;
        self.shared
            .tally
            .answer(&self.shared.worker, message.id, outcome)
    }
}

impl Enqueued {
    /// The messages that were enqueued: the committed ones and each
    /// uncertain batch whose rows are in the outbox (a batch is one
    /// transaction: all of its rows are there, or none).
    pub async fn settle(self, pool: &PgPool, schema: &str) -> Result<Vec<Expected>, String> {
        let ids: Vec<sqlx::types::Uuid> = self
            .uncertain
            .iter()
            .flatten()
            .map(|e| e.id.as_uuid())
            .collect();
        let present: HashSet<MessageId> = sqlx::query(AssertSqlSafe(format!(
            r#"SELECT id FROM "{schema}".{OUTBOX_TABLE} WHERE id = ANY($1)"#
        )))
        .bind(&ids)
        .fetch_all(pool)
        .await
        .map_err(|e| format!("looking up uncertain batches: {e}"))?
        .iter()
        .map(|r| MessageId::from_uuid(r.get(0)))
        .collect();
        self.settle_with(&present)
    }
}

/// Enqueues `count` messages with sqlx in transactions of 1–8 messages, as
/// [`check::enqueue_many`] does on SQLite (same sizes, keys and sequence
/// numbers from `rng`), through the shared writer loop: a transaction
/// that fails because the database is out of reach is tried again — unless
/// it was its `COMMIT` that failed: then the batch is kept as uncertain
/// (see [`Enqueued::settle`]). Any other failure is returned.
pub async fn enqueue_many(
    outbox: &PgOutbox,
    pool: &PgPool,
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
    outbox: &PgOutbox,
    pool: &PgPool,
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

/// One count from the test's schema, `None` while the database is out of
/// reach.
pub async fn count(pool: &PgPool, sql: &str) -> Option<u64> {
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .ok()
        .map(|n| n as u64)
}

/// The outbox rows in `schema` in `state` (`None` while out of reach).
pub async fn in_state(pool: &PgPool, schema: &str, state: &str) -> Option<u64> {
    count(
        pool,
        &format!(r#"SELECT count(*) FROM "{schema}".{OUTBOX_TABLE} WHERE state = '{state}'"#),
    )
    .await
}

/// Waits (up to 300 s) until the test's outbox in `schema` has nothing
/// pending, then stops every relay gracefully (each must still be
/// running); returns how long the drain took. `context` (the seed) starts
/// every failure message.
pub async fn drain_and_stop(
    pool: &PgPool,
    schema: &str,
    children: &mut [crate::RelayChild],
    context: &str,
) -> Duration {
    let drained = wait_until("the outbox to drain", Duration::from_secs(300), || async {
        in_state(pool, schema, "pending").await.map(|n| n == 0)
    })
    .await;
    crate::stop_all(children, Duration::from_secs(20), context);
    drained
}

/// Messages of the test's outbox in `schema` that still carry a lease:
/// after every relay stopped gracefully there must be none.
pub async fn leased(pool: &PgPool, schema: &str) -> Option<u64> {
    count(
        pool,
        &format!(r#"SELECT count(*) FROM "{schema}".{OUTBOX_TABLE} WHERE locked_by IS NOT NULL"#),
    )
    .await
}

/// Polls `condition` every 50 ms until it is `Some(true)`; panics naming
/// `what` after `timeout`. Returns how long it took.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut condition: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<bool>>,
{
    let start = Instant::now();
    loop {
        if condition().await == Some(true) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Compares what the receiver recorded in `schema` with `expected`.
pub async fn verify(pool: &PgPool, schema: &str, expected: &[Expected]) -> Report {
    let q = |sql: String| async move {
        count(pool, &sql)
            .await
            .unwrap_or_else(|| panic!("reading `{sql}` failed"))
    };
    let s = schema;
    let counts = Counts {
        effects: q(format!(r#"SELECT count(*) FROM "{s}".effects"#)).await,
        duplicates: q(format!(
            r#"SELECT COALESCE(SUM(value), 0)::bigint FROM "{s}".counters
               WHERE name LIKE 'duplicates/%'"#
        ))
        .await,
        calls: q(format!(r#"SELECT count(*) FROM "{s}".calls"#)).await,
        duplicate_calls: q(format!(
            r#"SELECT count(*) FROM "{s}".calls WHERE duplicate"#
        ))
        .await,
        not_processed: q(format!(
            r#"SELECT count(*) FROM "{s}".{OUTBOX_TABLE} WHERE state <> 'processed'"#
        ))
        .await,
        attempts_nonzero: q(format!(
            r#"SELECT count(*) FROM "{s}".{OUTBOX_TABLE} WHERE attempts <> 0"#
        ))
        .await,
    };
    let rows: Vec<EffectRow> = sqlx::query(AssertSqlSafe(format!(
        r#"SELECT message_id, key, seq, worker FROM "{s}".effects ORDER BY id"#
    )))
    .fetch_all(pool)
    .await
    .expect("reading the effects")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect();
    Report::compare(expected, counts, rows)
}

/// Ends one connection (chosen at random) whose `application_name` starts
/// with `prefix` — only `LISTEN` connections if `listeners` — with
/// `pg_terminate_backend`. Returns how many it ended (0 or 1).
pub async fn terminate_one(pool: &PgPool, prefix: &str, listeners: bool) -> Result<u64, String> {
    let listen = if listeners {
        "AND query LIKE 'LISTEN%'"
    } else {
        ""
    };
    let sql = format!(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE application_name LIKE $1 || '%' AND pid <> pg_backend_pid() {listen}
          ORDER BY random() LIMIT 1) t"
    );
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
        .bind(prefix)
        .fetch_one(pool)
        .await
        .map(|n| n as u64)
        .map_err(|e| format!("pg_terminate_backend: {e}"))
}

/// What a relay logs because its database was out of reach — each is
/// expected while connections are ended and the server restarts or
/// crashes.
pub const OUTAGE_LINES: &[&str] = &[
    // The store's errors of kind Unavailable (CountingStore).
    "[Unavailable]",
    // The relay on a store call that failed so: retried, or left to the lease.
    "error=unavailable",
    // The handler said so (PgReceiver), retried uncounted.
    "HANDLER_UNAVAILABLE",
    "handler temporarily unavailable; tried again later, not counted",
    // sqlx finding a pooled connection dead, or a statement that waited.
    "error occurred while testing the connection",
    "slow statement: execution time exceeded alert threshold",
    "time to acquire exceeded slow threshold",
    // The LISTEN connection ended; the listener polls until it is back.
    "outbox listener lost its connection",
    "outbox listener cannot LISTEN",
    // The server's goodbye to every connection when it is crashed
    // (`pg_ctl stop -m immediate`), which sqlx logs as a notice.
    "terminating connection due to immediate shutdown command",
];

/// The problem lines in a child's log (see
/// [`check::log_problems`]) that a database outage does not explain: every
/// one but those of [`OUTAGE_LINES`].
pub fn log_problems_beyond_outages(log: &std::path::Path) -> Vec<String> {
    check::log_problems_beyond(log, OUTAGE_LINES)
}
