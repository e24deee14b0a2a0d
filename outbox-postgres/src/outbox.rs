//! [`PgOutbox`]: enqueue and inbox inside the application's own sqlx
//! transaction.

use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::{Clock, Enqueue, Error, ErrorKind, MessageId, NewMessage, Result, Timestamp};
use sqlx::postgres::PgDatabaseError;
use sqlx::{AssertSqlSafe, PgConnection, Row};

use crate::announce::Announcer;
use crate::error::{duplicate_id, from_sqlx, is_unique_violation};
use crate::row::{Encoded, EncodedColumns};
use crate::schema::Sql;
use crate::store::to_i64;

/// Writes messages (and inbox entries) into the application's own
/// transaction. Get one from [`PgStore::outbox`](crate::PgStore::outbox);
/// cloning is cheap.
///
/// Enqueued messages become visible to relays when the application's
/// transaction commits; a rollback discards them. Nothing is sent from
/// inside that transaction: each enqueue hands its transaction id to the
/// store's commit watcher, which wakes this process's relays when the
/// transaction has committed and tells other processes with a debounced
/// `NOTIFY` of its own.
///
/// Messages with a key take a per-key advisory lock of the application's
/// transaction before they are written: two transactions enqueueing the
/// same key take turns (the second waits at its enqueue until the first
/// commits or rolls back), so that a key's messages are delivered in commit
/// order. Keyless messages take no lock.
#[derive(Clone)]
pub struct PgOutbox {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) sql: Arc<Sql>,
    announcer: Announcer,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for PgOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOutbox")
            .field("table", &self.shared.sql.names.outbox_display())
            .field("inbox_table", &self.shared.sql.names.inbox_display())
            .finish_non_exhaustive()
    }
}

impl PgOutbox {
    pub(crate) fn new(sql: Arc<Sql>, announcer: Announcer, clock: Arc<dyn Clock>) -> Self {
        PgOutbox {
            shared: Arc::new(Shared {
                sql,
                announcer,
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

    /// The schema's name.
    pub fn schema(&self) -> &str {
        &self.shared.sql.names.schema
    }

    /// Announces a commit that wrote to the outbox table without this
    /// handle (raw SQL): wakes this process's relays at once and other
    /// processes' within the debounce interval.
    pub fn notify(&self) {
        self.shared.announcer.committed();
    }

    fn encode(&self, message: NewMessage, now: Timestamp) -> Result<Encoded> {
        Ok(Encoded::new(message.into_message(now)?))
    }

    /// Validates and encodes `message` for an insert: the statement to run
    /// (the keyed one takes the key's lock first), the values to bind (in
    /// the order of `schema::INSERT_COLUMNS`) and the message's id. Shared
    /// by every driver.
    pub(crate) fn prepare_one(&self, message: NewMessage) -> Result<(&str, Encoded, MessageId)> {
        let e = self.encode(message, self.shared.clock.now())?;
        let id = e.id;
        let sql = if e.key.is_some() {
            &self.shared.sql.insert_keyed
        } else {
            &self.shared.sql.insert
        };
        Ok((sql.as_str(), e, id))
    }

    /// Validates and encodes a batch for `insert_many`: one array per
    /// column and the messages' ids, or `None` for an empty batch. One
    /// invalid message refuses the batch, naming its position.
    pub(crate) fn prepare_many(
        &self,
        messages: Vec<NewMessage>,
    ) -> Result<Option<(&str, EncodedColumns, Vec<MessageId>)>> {
        if messages.is_empty() {
            return Ok(None);
        }
        let now = self.shared.clock.now();
        let mut columns = EncodedColumns::default();
        for (i, m) in messages.into_iter().enumerate() {
            let e = self.encode(m, now).map_err(|err| {
                Error::new(
                    err.kind(),
                    format!("message {i} of the batch: {}", err.message()),
                )
            })?;
            columns.push(e);
        }
        let ids = columns
            .id
            .iter()
            .copied()
            .map(MessageId::from_uuid)
            .collect();
        Ok(Some((
            self.shared.sql.rare().insert_many.as_str(),
            columns,
            ids,
        )))
    }

    /// An insert returned its transaction's id: watch it, and announce the
    /// commit when it comes.
    pub(crate) fn inserted(&self, xid: &str) {
        self.shared.announcer.watch(xid);
    }

    /// The display name of the outbox table, for errors.
    pub(crate) fn table_display(&self) -> String {
        self.shared.sql.names.outbox_display()
    }

    /// The error for a batch one of whose ids exists already; `detail` is
    /// the server's detail line (naming the id), if any.
    pub(crate) fn batch_conflict(
        &self,
        detail: Option<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        Error::new(
            ErrorKind::Conflict,
            format!(
                "a message id of the batch exists already in outbox table `{}`{}",
                self.table_display(),
                detail.map(|d| format!(" ({d})")).unwrap_or_default()
            ),
        )
        .with_source(source)
    }

    /// Validates `message` and writes it into the application's transaction
    /// (or connection) `conn`, e.g. `&mut *tx`; returns its id. It becomes
    /// visible to relays when that transaction commits.
    ///
    /// An invalid message is an `InvalidInput` error and writes nothing; an
    /// id that exists already is a `Conflict` naming it (and, as any failed
    /// statement, aborts the application's transaction).
    pub async fn enqueue(&self, conn: &mut PgConnection, message: NewMessage) -> Result<MessageId> {
        let (sql, e, id) = self.prepare_one(message)?;
        let result = sqlx::query_scalar::<_, String>(AssertSqlSafe(sql))
            .bind(e.id.as_uuid())
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
            .fetch_one(conn)
            .await;
        match result {
            Ok(xid) => {
                self.inserted(&xid);
                Ok(id)
            }
            Err(err) if is_unique_violation(&err) => {
                Err(duplicate_id(id, &self.table_display(), err))
            }
            Err(err) => Err(self.fail(err, "enqueuing a message")),
        }
    }

    /// Validates every message and writes them all into `conn` with one
    /// statement, in the order given (their `seq` order); returns their ids.
    /// One invalid message refuses the whole batch and writes nothing.
    pub async fn enqueue_many(
        &self,
        conn: &mut PgConnection,
        messages: Vec<NewMessage>,
    ) -> Result<Vec<MessageId>> {
        let Some((sql, c, ids)) = self.prepare_many(messages)? else {
            return Ok(Vec::new());
        };
        let result = sqlx::query(AssertSqlSafe(sql))
            .bind(c.id)
            .bind(c.kind)
            .bind(c.message_type)
            .bind(c.key)
            .bind(c.exchange)
            .bind(c.routing_key)
            .bind(c.payload)
            .bind(c.content_type)
            .bind(c.headers)
            .bind(c.trace_parent)
            .bind(c.created_at)
            .bind(c.available_at)
            .fetch_one(conn)
            .await;
        match result {
            Ok(row) => {
                let xid: String = row
                    .try_get(0)
                    .map_err(|e| self.fail(e, "enqueuing messages"))?;
                self.inserted(&xid);
                Ok(ids)
            }
            Err(err) if is_unique_violation(&err) => {
                let detail = match &err {
                    sqlx::Error::Database(db) => db
                        .try_downcast_ref::<PgDatabaseError>()
                        .and_then(|d| d.detail().map(str::to_owned)),
                    _ => None,
                };
                Err(self.batch_conflict(detail, err))
            }
            Err(err) => Err(self.fail(err, "enqueuing messages")),
        }
    }

    fn fail(&self, e: sqlx::Error, what: &str) -> Error {
        from_sqlx(e, what, &self.shared.sql.names.outbox_display())
    }

    fn fail_inbox(&self, e: sqlx::Error, what: &str) -> Error {
        from_sqlx(e, what, &self.inbox_display())
    }

    /// `schema.inbox`, for messages.
    pub(crate) fn inbox_display(&self) -> String {
        self.shared.sql.names.inbox_display()
    }

    /// An [`Enqueue`] over a connection or transaction, for application code
    /// that is generic over the backend (and unit-tested on the memory
    /// backend).
    pub fn with_sqlx<'a>(&'a self, conn: &'a mut PgConnection) -> PgEnqueue<'a> {
        PgEnqueue { outbox: self, conn }
    }

    /// Records, in the application's transaction `conn`, that `consumer`
    /// handles `message_id`. Returns `false` when it was recorded before:
    /// the message was handled already — skip the work, still acknowledge.
    ///
    /// A second transaction recording the same pair while the first is
    /// open waits for it: `false` once it commits, `true` if it rolls back.
    pub async fn try_receive(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: MessageId,
    ) -> Result<bool> {
        let now = self.shared.clock.now().as_millis();
        let done = sqlx::query(AssertSqlSafe(self.shared.sql.rare().receive.as_str()))
            .bind(consumer)
            .bind(message_id.as_uuid())
            .bind(now)
            .execute(conn)
            .await
            .map_err(|e| self.fail_inbox(e, "recording an inbox entry"))?;
        Ok(done.rows_affected() == 1)
    }

    /// Deletes at most `limit` inbox entries received before `before`;
    /// returns how many ([`PgInbox`](crate::PgInbox)'s `purge`).
    pub(crate) async fn purge_inbox(
        &self,
        conn: &mut PgConnection,
        before: Timestamp,
        limit: usize,
    ) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        let done = sqlx::query(AssertSqlSafe(self.shared.sql.rare().purge_inbox.as_str()))
            .bind(before.as_millis())
            .bind(to_i64(limit))
            .execute(conn)
            .await
            .map_err(|e| self.fail_inbox(e, "purging the inbox"))?;
        Ok(done.rows_affected())
    }
}

/// A connection or transaction seen as an [`Enqueue`]; from
/// [`PgOutbox::with_sqlx`].
pub struct PgEnqueue<'a> {
    outbox: &'a PgOutbox,
    conn: &'a mut PgConnection,
}

impl std::fmt::Debug for PgEnqueue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgEnqueue")
            .field("outbox", self.outbox)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Enqueue for PgEnqueue<'_> {
    async fn enqueue(&mut self, message: NewMessage) -> Result<MessageId> {
        self.outbox.enqueue(&mut *self.conn, message).await
    }
}
