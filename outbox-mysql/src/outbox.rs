//! [`MySqlOutbox`]: enqueue (and inbox entries) inside the application's
//! own sqlx transaction.

use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::partition::of_key;
use outbox_api::{Clock, Enqueue, Error, ErrorKind, MessageId, NewMessage, Result, Timestamp};
use sqlx::{AssertSqlSafe, MySqlConnection};

use crate::error::{duplicate_id, from_sqlx, is_duplicate};
use crate::listener::Signals;
use crate::row::Encoded;
use crate::schema::{KEY_SLOTS, Sql, placeholders};
use crate::store::to_i64;

/// Writes messages (and inbox entries) into the application's own
/// transaction. Get one from [`MySqlStore::outbox`](crate::MySqlStore::outbox);
/// cloning is cheap.
///
/// Enqueued messages become visible to relays when the application's
/// transaction commits; a rollback discards them. Nothing is sent from
/// inside that transaction: each enqueue hands the id it wrote to the
/// store's commit watcher, which wakes this process's relays as soon as the
/// row is visible (committed). Other processes' relays find it by their
/// poll.
///
/// **Per-key order.** `AUTO_INCREMENT` values are drawn at insert, not at
/// commit, so two transactions enqueueing the same key could commit in the
/// other order than their `seq`s. A keyed enqueue therefore first locks its
/// key's row in `<table>_keys` (`SELECT … FOR UPDATE`, one of
/// [`KEY_SLOTS`] rows chosen by the key's hash): a second transaction
/// enqueueing the same key (or a key of the same slot) waits at its
/// enqueue until the first commits or rolls back, so that a key's `seq`
/// order is its commit order. The lock is an exclusive record lock on an
/// existing primary-key row: no gap lock at any isolation level. Keyless
/// messages take no lock. A transaction that enqueues several keys one by
/// one should do so in a consistent order (or in one
/// [`enqueue_many`](Self::enqueue_many), which locks its slots in order),
/// or two such transactions may deadlock — which the server resolves by
/// rolling one back (error 1213, an `Unavailable` error to retry).
#[derive(Clone)]
pub struct MySqlOutbox {
    shared: Arc<Shared>,
}

struct Shared {
    sql: Arc<Sql>,
    signals: Signals,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for MySqlOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlOutbox")
            .field("table", &self.shared.sql.names.outbox)
            .field("inbox_table", &self.shared.sql.names.inbox)
            .finish_non_exhaustive()
    }
}

/// The most messages one `INSERT` of [`MySqlOutbox::enqueue_many`] writes
/// (a prepared statement binds at most 65,535 values, 12 a message).
pub const BATCH_ROWS: usize = 4096;

/// The key-lock slot of `key`.
pub(crate) fn slot_of(key: &str) -> i16 {
    of_key(key, KEY_SLOTS) as i16
}

impl MySqlOutbox {
    pub(crate) fn new(sql: Arc<Sql>, signals: Signals, clock: Arc<dyn Clock>) -> Self {
        MySqlOutbox {
            shared: Arc::new(Shared {
                sql,
                signals,
                clock,
            }),
        }
    }

    /// The outbox table's name.
    pub fn table(&self) -> &str {
        &self.shared.sql.names.outbox
    }

    /// The inbox table's name.
    pub fn inbox_table(&self) -> &str {
        &self.shared.sql.names.inbox
    }

    /// Wakes this process's relays at once, e.g. after a commit that wrote
    /// to the outbox table with raw SQL.
    pub fn notify(&self) {
        self.shared.signals.wakeup.notify();
    }

    fn encode(&self, message: NewMessage, now: Timestamp) -> Result<Encoded> {
        Ok(Encoded::new(message.into_message(now)?))
    }

    /// Locks the key slots of `keys` (sorted, distinct) in the
    /// application's transaction.
    async fn lock_keys(&self, conn: &mut MySqlConnection, keys: &[&str]) -> Result<()> {
        let mut slots: Vec<i16> = keys.iter().map(|k| slot_of(k)).collect();
        slots.sort_unstable();
        slots.dedup();
        if slots.is_empty() {
            return Ok(());
        }
        let text = format!(
            "{}{} ORDER BY slot FOR UPDATE",
            self.shared.sql.lock_keys_head,
            placeholders(slots.len())
        );
        let mut q = sqlx::query(AssertSqlSafe(text));
        for s in &slots {
            q = q.bind(*s);
        }
        let locked = q
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.fail(e, "locking the messages' keys"))?;
        if locked.len() != slots.len() {
            return Err(Error::backend(format!(
                "the key-lock table `{}_keys` lacks rows; run `MySqlStore::migrate()`",
                self.table()
            )));
        }
        Ok(())
    }

    /// Validates `message` and writes it into the application's transaction
    /// (or connection) `conn`, e.g. `&mut *tx`; returns its id. It becomes
    /// visible to relays when that transaction commits.
    ///
    /// An invalid message is an `InvalidInput` error and writes nothing; an
    /// id that exists already is a `Conflict` naming it (MySQL undoes the
    /// failed statement only: the application's transaction goes on).
    pub async fn enqueue(
        &self,
        conn: &mut MySqlConnection,
        message: NewMessage,
    ) -> Result<MessageId> {
        let e = self.encode(message, self.shared.clock.now())?;
        let id = e.id;
        if let Some(key) = &e.key {
            self.lock_keys(conn, &[key.as_str()]).await?;
        }
        let text = format!(
            "{}{}",
            self.shared.sql.insert_head, self.shared.sql.insert_row
        );
        let q = bind_row(sqlx::query(AssertSqlSafe(text)), e);
        match q.execute(&mut *conn).await {
            Ok(_) => {
                self.shared.signals.watch(id);
                Ok(id)
            }
            Err(err) if is_duplicate(&err) => Err(duplicate_id(id, self.table(), err)),
            Err(err) => Err(self.fail(err, "enqueuing a message")),
        }
    }

    /// Validates every message and writes them all into `conn` with one
    /// `INSERT` per [`BATCH_ROWS`] messages (after locking their keys'
    /// slots in order), in the order given; returns their ids. One invalid message refuses the whole batch
    /// and writes nothing.
    pub async fn enqueue_many(
        &self,
        conn: &mut MySqlConnection,
        messages: Vec<NewMessage>,
    ) -> Result<Vec<MessageId>> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.shared.clock.now();
        let mut encoded = Vec::with_capacity(messages.len());
        for (i, m) in messages.into_iter().enumerate() {
            encoded.push(self.encode(m, now).map_err(|err| {
                Error::new(
                    err.kind(),
                    format!("message {i} of the batch: {}", err.message()),
                )
            })?);
        }
        let ids: Vec<MessageId> = encoded.iter().map(|e| e.id).collect();
        let keys: Vec<&str> = encoded.iter().filter_map(|e| e.key.as_deref()).collect();
        self.lock_keys(conn, &keys).await?;
        let sql = &self.shared.sql;
        let mut encoded = encoded.into_iter().peekable();
        while encoded.peek().is_some() {
            let chunk: Vec<Encoded> = encoded.by_ref().take(BATCH_ROWS).collect();
            let rows = vec![sql.insert_row; chunk.len()].join(", ");
            let mut q = sqlx::query(AssertSqlSafe(format!("{}{rows}", sql.insert_head)));
            for e in chunk {
                q = bind_row(q, e);
            }
            match q.execute(&mut *conn).await {
                Ok(_) => {}
                Err(err) if is_duplicate(&err) => {
                    return Err(self.batch_conflict(conn, &ids, err).await);
                }
                Err(err) => return Err(self.fail(err, "enqueuing messages")),
            }
        }
        self.shared.signals.watch(ids[0]);
        Ok(ids)
    }

    /// The error for a batch one of whose ids exists already: names the
    /// ids the table holds (or says the batch repeats one).
    async fn batch_conflict(
        &self,
        conn: &mut MySqlConnection,
        ids: &[MessageId],
        source: sqlx::Error,
    ) -> Error {
        let text = format!(
            "{}{}",
            self.shared.sql.existing_head,
            placeholders(ids.len())
        );
        let mut q = sqlx::query_scalar::<_, uuid::Uuid>(AssertSqlSafe(text));
        for id in ids {
            q = q.bind(id.as_uuid());
        }
        let which = match q.fetch_all(&mut *conn).await {
            Ok(found) if !found.is_empty() => found
                .iter()
                .map(|u| MessageId::from_uuid(*u).to_string())
                .collect::<Vec<_>>()
                .join(", "),
            _ => "none the table holds (the batch repeats an id)".to_owned(),
        };
        Error::new(
            ErrorKind::Conflict,
            format!(
                "a message id of the batch exists already in outbox table `{}`: {which}",
                self.table()
            ),
        )
        .with_source(source)
    }

    fn fail(&self, e: sqlx::Error, what: &str) -> Error {
        from_sqlx(e, what, &self.shared.sql.names.outbox)
    }

    pub(crate) fn fail_inbox(&self, e: sqlx::Error, what: &str) -> Error {
        from_sqlx(e, what, &self.shared.sql.names.inbox)
    }

    /// An [`Enqueue`] over a connection or transaction, for application code
    /// that is generic over the backend (and unit-tested on the memory
    /// backend).
    pub fn with_sqlx<'a>(&'a self, conn: &'a mut MySqlConnection) -> MySqlEnqueue<'a> {
        MySqlEnqueue { outbox: self, conn }
    }

    /// Records, in the application's transaction `conn`, that `consumer`
    /// handles `message_id`. Returns `false` when it was recorded before:
    /// the message was handled already — skip the work, still acknowledge.
    ///
    /// A second transaction recording the same pair while the first is
    /// open waits for it: `false` once it commits, `true` if it rolls back.
    pub async fn try_receive(
        &self,
        conn: &mut MySqlConnection,
        consumer: &str,
        message_id: MessageId,
    ) -> Result<bool> {
        let now = self.shared.clock.now().as_millis();
        let done = sqlx::query(AssertSqlSafe(self.shared.sql.receive.as_str()))
            .bind(consumer.as_bytes())
            .bind(message_id.as_uuid())
            .bind(now)
            .execute(conn)
            .await;
        match done {
            Ok(_) => Ok(true),
            Err(e) if is_duplicate(&e) => Ok(false),
            Err(e) => Err(self.fail_inbox(e, "recording an inbox entry")),
        }
    }

    /// Whether `(consumer, message_id)` is recorded as `conn` sees it: in
    /// the inbox transaction, whether that transaction still holds its
    /// entry (a deadlock rolls the whole transaction back).
    pub(crate) async fn holds_entry(
        &self,
        conn: &mut MySqlConnection,
        consumer: &str,
        message_id: MessageId,
    ) -> std::result::Result<bool, sqlx::Error> {
        let row = sqlx::query(AssertSqlSafe(self.shared.sql.received.as_str()))
            .bind(consumer.as_bytes())
            .bind(message_id.as_uuid())
            .fetch_optional(conn)
            .await?;
        Ok(row.is_some())
    }

    /// Deletes at most `limit` inbox entries received before `before`;
    /// returns how many.
    pub(crate) async fn purge_inbox(
        &self,
        conn: &mut MySqlConnection,
        before: Timestamp,
        limit: usize,
    ) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        let done = sqlx::query(AssertSqlSafe(self.shared.sql.purge_inbox.as_str()))
            .bind(before.as_millis())
            .bind(to_i64(limit))
            .execute(conn)
            .await
            .map_err(|e| self.fail_inbox(e, "purging the inbox"))?;
        Ok(done.rows_affected())
    }
}

/// Binds one message's values in the order of `schema::Sql::insert_row`.
fn bind_row(
    q: sqlx::query::Query<'_, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    e: Encoded,
) -> sqlx::query::Query<'_, sqlx::MySql, sqlx::mysql::MySqlArguments> {
    q.bind(e.id.as_uuid())
        .bind(e.kind)
        .bind(e.message_type)
        .bind(e.key.map(String::into_bytes))
        .bind(e.exchange)
        .bind(e.routing_key)
        .bind(e.payload)
        .bind(e.content_type)
        .bind(e.headers)
        .bind(e.trace_parent)
        .bind(e.created_at)
        .bind(e.available_at)
}

/// A connection or transaction seen as an [`Enqueue`]; from
/// [`MySqlOutbox::with_sqlx`].
pub struct MySqlEnqueue<'a> {
    outbox: &'a MySqlOutbox,
    conn: &'a mut MySqlConnection,
}

impl std::fmt::Debug for MySqlEnqueue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlEnqueue")
            .field("outbox", self.outbox)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Enqueue for MySqlEnqueue<'_> {
    async fn enqueue(&mut self, message: NewMessage) -> Result<MessageId> {
        self.outbox.enqueue(&mut *self.conn, message).await
    }
}
