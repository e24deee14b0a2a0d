//! The receiving side: a domain handler that records each delivery in a
//! receiver database, deduplicated by the inbox, in one transaction.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{Dispatcher, HandlerError, Message, Timestamp};
use outbox_sqlite::rusqlite::{self, Connection, TransactionBehavior, params};
use outbox_sqlite::{SqliteOutbox, SqliteStore};

use crate::tally::Tally;

/// The message type the tests enqueue and the [`Receiver`] handles.
pub const MESSAGE_TYPE: &str = "FaultTest";
/// The (unused) outbox table of the receiver's [`SqliteStore`]; only its
/// inbox is used.
pub const RECEIVER_OUTBOX_TABLE: &str = "receiver_outbox";
/// The receiver's inbox table.
pub const RECEIVER_INBOX_TABLE: &str = "receiver_inbox";

/// Opens a rusqlite connection the way the tests and the child use it:
/// 5 s busy timeout, WAL, `synchronous = NORMAL` (a SIGKILL loses nothing
/// that was committed: the WAL is in the OS page cache).
pub fn open_connection(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    let _mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    conn.execute_batch("PRAGMA synchronous = NORMAL")?;
    Ok(conn)
}

/// Creates the receiver's own tables (idempotent, safe from several
/// processes at once):
///
/// * `effects`: one row per message handled for the first time — message
///   id, ordering key, the sequence number from the payload, the payload,
///   the worker; its `rowid` is the order in which effects were committed;
/// * `calls`: one row per handler invocation that committed, duplicate or
///   not (the inbox would hide duplicates from `effects`);
/// * `counters`: `duplicates`, bumped when the inbox says "seen before".
pub fn prepare_receiver_schema(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN IMMEDIATE;
         CREATE TABLE IF NOT EXISTS effects (
             rowid       INTEGER PRIMARY KEY AUTOINCREMENT,
             message_id  TEXT    NOT NULL,
             key         TEXT,
             seq         INTEGER NOT NULL,
             payload     BLOB    NOT NULL,
             worker      TEXT    NOT NULL,
             at_ms       INTEGER NOT NULL
         );
         CREATE INDEX IF NOT EXISTS effects_message_idx ON effects (message_id);
         CREATE TABLE IF NOT EXISTS calls (
             rowid       INTEGER PRIMARY KEY AUTOINCREMENT,
             message_id  TEXT    NOT NULL,
             worker      TEXT    NOT NULL,
             duplicate   INTEGER NOT NULL,
             at_ms       INTEGER NOT NULL
         );
         CREATE TABLE IF NOT EXISTS counters (
             name   TEXT PRIMARY KEY,
             value  INTEGER NOT NULL
         );
         COMMIT;",
    )
}

/// The domain handler of the fault tests.
///
/// For each message it sleeps `delay` (if any), then inside ONE
/// `BEGIN IMMEDIATE` transaction on the receiver database records the
/// message in the inbox (`try_receive_rusqlite`) and, if it is new, inserts
/// its effect row — or, if the inbox has seen it, bumps the `duplicates`
/// counter — and records the call; then commits. A failure is printed to
/// stderr as a `HANDLER_ERROR` line naming the statement, and returned.
#[derive(Clone)]
pub struct Receiver {
    shared: Arc<Shared>,
}

struct Shared {
    conn: Mutex<Connection>,
    inbox: SqliteOutbox,
    consumer: String,
    worker: String,
    delay: Duration,
    tally: Tally,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("consumer", &self.shared.consumer)
            .field("worker", &self.shared.worker)
            .finish_non_exhaustive()
    }
}

impl Receiver {
    /// Opens the receiver database at `path` (creating its tables and inbox)
    /// for the relay `worker`, handling as inbox consumer `consumer`.
    pub async fn open(
        path: &Path,
        consumer: &str,
        worker: &str,
        delay: Duration,
    ) -> Result<Receiver, String> {
        let store = SqliteStore::builder(path)
            .table(RECEIVER_OUTBOX_TABLE)
            .inbox_table(RECEIVER_INBOX_TABLE)
            .connect()
            .await
            .map_err(|e| format!("opening the receiver database: {e}"))?;
        store
            .migrate()
            .await
            .map_err(|e| format!("creating the receiver inbox: {e}"))?;
        let conn = open_connection(path)
            .and_then(|c| prepare_receiver_schema(&c).map(|()| c))
            .map_err(|e| format!("preparing the receiver tables: {e}"))?;
        Ok(Receiver {
            shared: Arc::new(Shared {
                conn: Mutex::new(conn),
                inbox: store.outbox(),
                consumer: consumer.to_owned(),
                worker: worker.to_owned(),
                delay,
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

    /// Every handler failure so far, naming the statement.
    pub fn errors(&self) -> Vec<String> {
        self.shared.tally.errors()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// The receiver transaction; returns whether the message was new.
    fn record(&self, m: &Message) -> Result<bool, String> {
        let seq: i64 = std::str::from_utf8(&m.payload)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("payload of {} is not a sequence number", m.id))?;
        let id = m.id.to_string();
        let now = Timestamp::now().as_millis();
        let mut conn = lock(&self.conn);
        let step = |what: &str| {
            let what = what.to_owned();
            move |e: rusqlite::Error| format!("{what}: {e}")
        };
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(step("BEGIN IMMEDIATE"))?;
        let new = self
            .inbox
            .try_receive_rusqlite(&tx, &self.consumer, m.id)
            .map_err(|e| format!("try_receive_rusqlite: {e}"))?;
        if new {
            tx.prepare_cached(
                "INSERT INTO effects (message_id, key, seq, payload, worker, at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .and_then(|mut s| s.execute(params![id, m.key, seq, m.payload, self.worker, now]))
            .map_err(step("INSERT INTO effects"))?;
        } else {
            tx.prepare_cached(
                "INSERT INTO counters (name, value) VALUES ('duplicates', 1)
                 ON CONFLICT (name) DO UPDATE SET value = value + 1",
            )
            .and_then(|mut s| s.execute([]))
            .map_err(step("UPDATE counters"))?;
        }
        tx.prepare_cached(
            "INSERT INTO calls (message_id, worker, duplicate, at_ms) VALUES (?1, ?2, ?3, ?4)",
        )
        .and_then(|mut s| s.execute(params![id, self.worker, !new, now]))
        .map_err(step("INSERT INTO calls"))?;
        tx.commit().map_err(step("COMMIT"))?;
        Ok(new)
    }
}

#[async_trait]
impl Dispatcher for Receiver {
    async fn dispatch(&self, message: &Message) -> Result<(), HandlerError> {
        if !self.shared.delay.is_zero() {
            tokio::time::sleep(self.shared.delay).await;
        }
        let shared = Arc::clone(&self.shared);
        let m = message.clone();
        let result = tokio::task::spawn_blocking(move || shared.record(&m))
            .await
            .unwrap_or_else(|e| Err(format!("receiver task failed: {e}")));
        self.shared
            .tally
            .count(&self.shared.worker, message.id, result)
    }
}
