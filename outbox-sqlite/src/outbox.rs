//! [`SqliteOutbox`]: enqueue and inbox inside the application's own
//! transaction, with sqlx or rusqlite.

use std::sync::Arc;
#[cfg(any(feature = "sqlx", feature = "rusqlite"))]
use std::sync::atomic::{AtomicBool, Ordering};

#[cfg(feature = "sqlx")]
use async_trait::async_trait;
#[cfg(feature = "sqlx")]
use outbox_api::Enqueue;
use outbox_api::{Clock, MessageId, NewMessage, Result};

use crate::listener::Signals;

#[cfg(any(feature = "sqlx", feature = "rusqlite"))]
use crate::error::duplicate_id;
#[cfg(any(feature = "sqlx", feature = "rusqlite"))]
use crate::error::from_rusqlite;
#[cfg(feature = "sqlx")]
use crate::error::from_sqlx;
#[cfg(feature = "rusqlite")]
use crate::error::is_unique_violation;
use crate::row::Encoded;
use crate::schema::Sql;

/// Writes messages (and inbox entries) into the application's own
/// transaction, with either driver. Get one from
/// [`SqliteStore::outbox`](crate::SqliteStore::outbox); cloning is cheap.
///
/// Enqueued messages become visible to relays when the application's
/// transaction commits; a rollback discards them. Each enqueue also hints
/// this process's listening relays, which then watch for the commit and
/// wake within microseconds of it; commits by other processes are noticed
/// by the listeners' `PRAGMA data_version` poll.
#[derive(Clone)]
pub struct SqliteOutbox {
    shared: Arc<Shared>,
}

struct Shared {
    sql: Arc<Sql>,
    #[cfg(feature = "sqlx")]
    sqlx_insert: Arc<str>,
    #[cfg(feature = "sqlx")]
    sqlx_receive: Arc<str>,
    #[cfg(feature = "sqlx")]
    sqlx_purge_inbox: Arc<str>,
    signals: Signals,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for SqliteOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteOutbox")
            .field("table", &self.shared.sql.outbox)
            .field("inbox_table", &self.shared.sql.inbox)
            .finish_non_exhaustive()
    }
}

impl SqliteOutbox {
    pub(crate) fn new(sql: Arc<Sql>, signals: Signals, clock: Arc<dyn Clock>) -> Self {
        SqliteOutbox {
            shared: Arc::new(Shared {
                #[cfg(feature = "sqlx")]
                sqlx_insert: Arc::from(sql.insert.as_str()),
                #[cfg(feature = "sqlx")]
                sqlx_receive: Arc::from(sql.receive.as_str()),
                #[cfg(feature = "sqlx")]
                sqlx_purge_inbox: Arc::from(sql.purge_inbox.as_str()),
                sql,
                signals,
                clock,
            }),
        }
    }

    /// The outbox table's name.
    pub fn table(&self) -> &str {
        &self.shared.sql.outbox
    }

    /// The inbox table's name.
    pub fn inbox_table(&self) -> &str {
        &self.shared.sql.inbox
    }

    /// Wakes this process's listening relays, e.g. after a commit that
    /// wrote to the outbox table with raw SQL.
    pub fn notify(&self) {
        self.shared.signals.definite.notify();
    }

    #[cfg(any(feature = "sqlx", feature = "rusqlite"))]
    fn encode(&self, message: NewMessage) -> Result<(MessageId, Encoded)> {
        let m = message.into_message(self.shared.clock.now())?;
        Ok((m.id, Encoded::new(m)))
    }

    /// Validates `message` and writes it with sqlx into the transaction (or
    /// connection) `executor`, e.g. `&mut *tx`; returns its id. It becomes
    /// visible to relays when that transaction commits.
    ///
    /// An invalid message is an `InvalidInput` error and writes nothing; an
    /// id that exists already is a `Conflict` naming it.
    #[cfg(feature = "sqlx")]
    pub async fn enqueue<'c, E>(&self, executor: E, message: NewMessage) -> Result<MessageId>
    where
        E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
    {
        let (id, e) = self.encode(message)?;
        let result = sqlx::query(sqlx::AssertSqlSafe(Arc::clone(&self.shared.sqlx_insert)))
            .bind(e.id.to_string())
            .bind(e.kind)
            .bind(e.message_type)
            .bind(e.key)
            .bind(e.exchange)
            .bind(e.routing_key)
            .bind(e.payload)
            .bind(e.content_type)
            .bind(e.headers)
            .bind(e.trace_parent)
            .bind(e.created_at)
            .bind(e.available_at)
            .execute(executor)
            .await;
        match result {
            Ok(_) => {
                self.shared.signals.hint.notify();
                Ok(id)
            }
            Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                Err(duplicate_id(id, self.table(), sqlx::Error::Database(db)))
            }
            Err(err) => Err(from_sqlx(err, "enqueuing a message", self.table())),
        }
    }

    /// Validates `message` and writes it with rusqlite into the open
    /// transaction `conn` (a `&rusqlite::Transaction` derefs to it); returns
    /// its id. It becomes visible to relays when that transaction commits.
    #[cfg(feature = "rusqlite")]
    pub fn enqueue_rusqlite(
        &self,
        conn: &rusqlite::Connection,
        message: NewMessage,
    ) -> Result<MessageId> {
        let (id, e) = self.encode(message)?;
        let result = conn
            .prepare_cached(&self.shared.sql.insert)
            .and_then(|mut stmt| {
                stmt.execute(rusqlite::params![
                    e.id.to_string(),
                    e.kind,
                    e.message_type,
                    e.key,
                    e.exchange,
                    e.routing_key,
                    e.payload,
                    e.content_type,
                    e.headers,
                    e.trace_parent,
                    e.created_at,
                    e.available_at
                ])
            });
        match result {
            Ok(_) => {
                self.shared.signals.hint.notify();
                Ok(id)
            }
            Err(err) if is_unique_violation(&err) => Err(duplicate_id(id, self.table(), err)),
            Err(err) => Err(from_rusqlite(err, "enqueuing a message", self.table())),
        }
    }

    /// Installs SQLite hooks on an sqlx connection so that every commit that
    /// inserted into this outbox table hints this process's listening relays
    /// the moment it commits (the enqueue itself hints too, but a relay only
    /// watches closely for 10 ms after a hint; attach connections whose
    /// transactions run longer). Call it once per connection, e.g. from
    /// `SqlitePoolOptions::after_connect`. It replaces any update, commit and
    /// rollback hooks set on the connection before.
    ///
    /// It also replaces the connection's busy handler with the store's: a
    /// connection that meets the write lock held (by a relay's claim or
    /// completion, say) tries again after 50 µs, 100 µs, … up to 1 ms
    /// between tries, for as long as the connection's own `busy_timeout`,
    /// instead of SQLite's 1, 2, 5, 10 … ms. A relay's transaction holds the
    /// lock for well under a millisecond, so SQLite's first pause alone was
    /// longer than the wait; on a connection that all of an application's
    /// writes share, those pauses were its throughput
    /// (`docs/latency.md`).
    #[cfg(feature = "sqlx")]
    pub async fn attach(&self, conn: &mut sqlx::SqliteConnection) -> Result<()> {
        let timeout_ms: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| from_sqlx(e, "reading the busy timeout", self.table()))?;
        let mut handle = conn
            .lock_handle()
            .await
            .map_err(|e| from_sqlx(e, "attaching commit hooks", self.table()))?;
        let dirty = Arc::new(AtomicBool::new(false));
        let (d, table) = (Arc::clone(&dirty), self.table().to_owned());
        handle.set_update_hook(move |r: sqlx::sqlite::UpdateHookResult<'_>| {
            if matches!(r.operation, sqlx::sqlite::SqliteOperation::Insert) && r.table == table {
                d.store(true, Ordering::Relaxed);
            }
        });
        let (d, hint) = (Arc::clone(&dirty), self.shared.signals.hint.clone());
        handle.set_commit_hook(move || {
            if d.swap(false, Ordering::Relaxed) {
                hint.notify();
            }
            true // go on committing
        });
        handle.set_rollback_hook(move || dirty.store(false, Ordering::Relaxed));
        let db = handle.as_raw_handle().as_ptr();
        // SAFETY: `handle` keeps the connection open and locked for us: no
        // statement runs on it during the call.
        #[allow(unsafe_code)]
        unsafe { crate::lock_wait::install_on(db, timeout_ms) }
            .map_err(|e| from_rusqlite(e, "installing the busy handler", self.table()))?;
        Ok(())
    }

    /// [`attach`](Self::attach) for a rusqlite connection: the same hooks,
    /// and the same busy handler within the connection's `busy_timeout`.
    #[cfg(feature = "rusqlite")]
    pub fn attach_rusqlite(&self, conn: &rusqlite::Connection) -> Result<()> {
        let fail = |e| from_rusqlite(e, "attaching commit hooks", self.table());
        let dirty = Arc::new(AtomicBool::new(false));
        let (d, table) = (Arc::clone(&dirty), self.table().to_owned());
        conn.update_hook(Some(move |action, _db: &str, t: &str, _rowid| {
            if action == rusqlite::hooks::Action::SQLITE_INSERT && t == table {
                d.store(true, Ordering::Relaxed);
            }
        }))
        .map_err(fail)?;
        let (d, hint) = (Arc::clone(&dirty), self.shared.signals.hint.clone());
        conn.commit_hook(Some(move || {
            if d.swap(false, Ordering::Relaxed) {
                hint.notify();
            }
            false // false: do not turn the commit into a rollback
        }))
        .map_err(fail)?;
        conn.rollback_hook(Some(move || dirty.store(false, Ordering::Relaxed)))
            .map_err(fail)?;
        let timeout_ms = conn
            .pragma_query_value(None, "busy_timeout", |row| row.get::<_, i64>(0))
            .map_err(fail)?;
        // SAFETY: `conn` is open and borrowed by this call: no other thread
        // uses it meanwhile.
        #[allow(unsafe_code)]
        unsafe { crate::lock_wait::install_on(conn.handle(), timeout_ms) }.map_err(fail)?;
        Ok(())
    }

    /// An [`Enqueue`] over an sqlx connection or transaction, for
    /// application code that is generic over the backend (and unit-tested
    /// on the memory backend).
    #[cfg(feature = "sqlx")]
    pub fn with_sqlx<'a>(&'a self, conn: &'a mut sqlx::SqliteConnection) -> SqliteEnqueue<'a> {
        SqliteEnqueue { outbox: self, conn }
    }

    /// Records with sqlx, in the transaction `executor`, that `consumer`
    /// handles `message_id`. Returns `false` when it was recorded before:
    /// the message was handled already — skip the work, still acknowledge.
    #[cfg(feature = "sqlx")]
    pub async fn try_receive<'c, E>(
        &self,
        executor: E,
        consumer: &str,
        message_id: MessageId,
    ) -> Result<bool>
    where
        E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
    {
        let now = self.shared.clock.now().as_millis();
        let done = sqlx::query(sqlx::AssertSqlSafe(Arc::clone(&self.shared.sqlx_receive)))
            .bind(consumer.to_owned())
            .bind(message_id.to_string())
            .bind(now)
            .execute(executor)
            .await
            .map_err(|e| from_sqlx(e, "recording an inbox entry", self.inbox_table()))?;
        Ok(done.rows_affected() == 1)
    }

    /// [`try_receive`](Self::try_receive) with rusqlite, in the open
    /// transaction `conn`.
    #[cfg(feature = "rusqlite")]
    pub fn try_receive_rusqlite(
        &self,
        conn: &rusqlite::Connection,
        consumer: &str,
        message_id: MessageId,
    ) -> Result<bool> {
        let now = self.shared.clock.now().as_millis();
        let n = conn
            .prepare_cached(&self.shared.sql.receive)
            .and_then(|mut s| s.execute(rusqlite::params![consumer, message_id.to_string(), now]))
            .map_err(|e| from_rusqlite(e, "recording an inbox entry", self.inbox_table()))?;
        Ok(n == 1)
    }

    /// Deletes at most `limit` inbox entries received before `before`, with
    /// sqlx; returns how many ([`SqliteInbox`](crate::SqliteInbox)'s `purge`).
    #[cfg(feature = "sqlx")]
    pub(crate) async fn purge_inbox<'c, E>(
        &self,
        executor: E,
        before: outbox_api::Timestamp,
        limit: usize,
    ) -> Result<u64>
    where
        E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
    {
        let done = sqlx::query(sqlx::AssertSqlSafe(Arc::clone(
            &self.shared.sqlx_purge_inbox,
        )))
        .bind(before.as_millis())
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(executor)
        .await
        .map_err(|e| from_sqlx(e, "purging the inbox", self.inbox_table()))?;
        Ok(done.rows_affected())
    }
}

/// An sqlx connection or transaction seen as an [`Enqueue`]; from
/// [`SqliteOutbox::with_sqlx`].
#[cfg(feature = "sqlx")]
pub struct SqliteEnqueue<'a> {
    outbox: &'a SqliteOutbox,
    conn: &'a mut sqlx::SqliteConnection,
}

#[cfg(feature = "sqlx")]
impl std::fmt::Debug for SqliteEnqueue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteEnqueue")
            .field("outbox", self.outbox)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "sqlx")]
#[async_trait]
impl Enqueue for SqliteEnqueue<'_> {
    async fn enqueue(&mut self, message: NewMessage) -> Result<MessageId> {
        self.outbox.enqueue(&mut *self.conn, message).await
    }
}
