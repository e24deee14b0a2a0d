//! Enqueue inside a `tokio_postgres` transaction (feature `tokio-postgres`):
//! the same statements, validation, errors and post-commit announcement as
//! the sqlx path, bound through tokio-postgres.
//!
//! [`PgOutbox::enqueue_tokio_postgres`] runs its statement with
//! [`GenericClient::query_typed`]: the parameter types are given with the
//! values, so the statement is parsed, bound and run in one round trip, with
//! no prepared statement left on the application's connection — but parsed
//! and planned on every call. An application that keeps its connections
//! prepares the statements once per connection
//! ([`PgOutbox::prepare_tokio_postgres`]) and enqueues with
//! [`PgOutbox::enqueue_prepared`], as it would its own statements.

use outbox_api::{Error, ErrorKind, MessageId, NewMessage, Result};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, Statement};

use crate::error::{duplicate_id, from_tokio_postgres};
use crate::outbox::PgOutbox;
use crate::row::{Encoded, EncodedColumns};

type Param<'a> = (&'a (dyn ToSql + Sync), Type);

/// The values of an insert of `e` (whose id is `id`) with their types, in
/// the order of `schema::INSERT_COLUMNS` (`$9`, the headers, is text cast
/// to jsonb by the statement).
fn typed_params<'a>(e: &'a Encoded, id: &'a uuid::Uuid) -> [Param<'a>; 12] {
    [
        (id, Type::UUID),
        (&e.kind, Type::TEXT),
        (&e.message_type, Type::TEXT),
        (&e.key, Type::TEXT),
        (&e.exchange, Type::TEXT),
        (&e.routing_key, Type::TEXT),
        (&e.payload, Type::BYTEA),
        (&e.content_type, Type::TEXT),
        (&e.headers, Type::TEXT),
        (&e.trace_parent, Type::TEXT),
        (&e.created_at, Type::INT8),
        (&e.available_at, Type::INT8),
    ]
}

impl EncodedColumns {
    /// The arrays of `insert_many` with their types, in the same order.
    fn typed_params(&self) -> [Param<'_>; 12] {
        [
            (&self.id, Type::UUID_ARRAY),
            (&self.kind, Type::TEXT_ARRAY),
            (&self.message_type, Type::TEXT_ARRAY),
            (&self.key, Type::TEXT_ARRAY),
            (&self.exchange, Type::TEXT_ARRAY),
            (&self.routing_key, Type::TEXT_ARRAY),
            (&self.payload, Type::BYTEA_ARRAY),
            (&self.content_type, Type::TEXT_ARRAY),
            (&self.headers, Type::TEXT_ARRAY),
            (&self.trace_parent, Type::TEXT_ARRAY),
            (&self.created_at, Type::INT8_ARRAY),
            (&self.available_at, Type::INT8_ARRAY),
        ]
    }
}

fn is_unique_violation(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::UNIQUE_VIOLATION)
}

/// The single-message enqueue statements of one outbox table, prepared on
/// one tokio-postgres connection by [`PgOutbox::prepare_tokio_postgres`].
///
/// Like any [`Statement`], they belong to the connection that prepared
/// them: use them only with that connection (or a transaction on it), and
/// prepare again after reconnecting. On another connection the statement
/// is unknown: PostgreSQL refuses it, and the transaction is aborted.
#[derive(Debug, Clone)]
pub struct PreparedEnqueue {
    table: String,
    insert: Statement,
    insert_keyed: Statement,
}

/// The parameter types of an insert, in the order of `typed_params`.
const INSERT_TYPES: [Type; 12] = [
    Type::UUID,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT8,
];

impl PgOutbox {
    /// [`enqueue`](PgOutbox::enqueue) through tokio-postgres: validates
    /// `message` and writes it in `client` — the application's
    /// `tokio_postgres::Transaction` (or any
    /// [`GenericClient`]); returns its id. It becomes visible to relays
    /// when that transaction commits, and this store's relays (and, after
    /// the commit, other processes') are woken as for the sqlx path.
    ///
    /// The same statement and the same errors as the sqlx path: an invalid
    /// message is `InvalidInput` and writes nothing; an existing id is a
    /// `Conflict` naming it (and aborts the application's transaction).
    /// A keyed message takes the key's lock, as there.
    pub async fn enqueue_tokio_postgres<C>(
        &self,
        client: &C,
        message: NewMessage,
    ) -> Result<MessageId>
    where
        C: GenericClient + Sync,
    {
        let (sql, e, id) = self.prepare_one(message)?;
        let uuid = e.id.as_uuid();
        let result = client.query_typed(sql, &typed_params(&e, &uuid)).await;
        self.inserted_one(result, id)
    }

    /// Prepares this outbox's enqueue statements on `client`'s connection,
    /// for [`enqueue_prepared`](Self::enqueue_prepared) on that connection:
    /// one round trip per statement, once per connection, where
    /// [`enqueue_tokio_postgres`](Self::enqueue_tokio_postgres) parses its
    /// statement on every call.
    pub async fn prepare_tokio_postgres<C>(&self, client: &C) -> Result<PreparedEnqueue>
    where
        C: GenericClient + Sync,
    {
        let what = "preparing the enqueue statements";
        let sql = &self.shared.sql;
        let insert = client
            .prepare_typed(&sql.insert, &INSERT_TYPES)
            .await
            .map_err(|e| self.fail_tp(e, what))?;
        let insert_keyed = client
            .prepare_typed(&sql.insert_keyed, &INSERT_TYPES)
            .await
            .map_err(|e| self.fail_tp(e, what))?;
        Ok(PreparedEnqueue {
            table: self.table_display(),
            insert,
            insert_keyed,
        })
    }

    /// [`enqueue_tokio_postgres`](Self::enqueue_tokio_postgres) with the
    /// statements `prepared` on `client`'s connection: the same validation,
    /// key lock, errors and announcement, without parsing the statement
    /// again. Statements prepared for another outbox table are refused
    /// (`Config`) before anything is written.
    pub async fn enqueue_prepared<C>(
        &self,
        client: &C,
        prepared: &PreparedEnqueue,
        message: NewMessage,
    ) -> Result<MessageId>
    where
        C: GenericClient + Sync,
    {
        let table = self.table_display();
        if prepared.table != table {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "the enqueue statements were prepared for outbox table `{}`, not `{table}`",
                    prepared.table
                ),
            ));
        }
        let (_, e, id) = self.prepare_one(message)?;
        let statement = if e.key.is_some() {
            &prepared.insert_keyed
        } else {
            &prepared.insert
        };
        let uuid = e.id.as_uuid();
        let params = typed_params(&e, &uuid);
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
        let result = client.query(statement, &values).await;
        self.inserted_one(result, id)
    }

    /// The outcome of a single insert: its transaction watched, or the
    /// error (a duplicate id named).
    fn inserted_one(
        &self,
        result: std::result::Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>,
        id: MessageId,
    ) -> Result<MessageId> {
        match result {
            Ok(rows) => {
                let xid = xid_of(&rows).map_err(|err| self.fail_tp(err, "enqueuing a message"))?;
                self.inserted(&xid);
                Ok(id)
            }
            Err(err) if is_unique_violation(&err) => {
                Err(duplicate_id(id, &self.table_display(), err))
            }
            Err(err) => Err(self.fail_tp(err, "enqueuing a message")),
        }
    }

    /// [`enqueue_many`](PgOutbox::enqueue_many) through tokio-postgres: every
    /// message validated, then all written in `client` with one statement,
    /// in the order given; returns their ids. One invalid message refuses
    /// the whole batch and writes nothing.
    pub async fn enqueue_many_tokio_postgres<C>(
        &self,
        client: &C,
        messages: Vec<NewMessage>,
    ) -> Result<Vec<MessageId>>
    where
        C: GenericClient + Sync,
    {
        let Some((sql, columns, ids)) = self.prepare_many(messages)? else {
            return Ok(Vec::new());
        };
        match client.query_typed(sql, &columns.typed_params()).await {
            Ok(rows) => {
                let xid = xid_of(&rows).map_err(|err| self.fail_tp(err, "enqueuing messages"))?;
                self.inserted(&xid);
                Ok(ids)
            }
            Err(err) if is_unique_violation(&err) => {
                let detail = err
                    .as_db_error()
                    .and_then(|d| d.detail().map(str::to_owned));
                Err(self.batch_conflict(detail, err))
            }
            Err(err) => Err(self.fail_tp(err, "enqueuing messages")),
        }
    }

    fn fail_tp(&self, e: tokio_postgres::Error, what: &str) -> outbox_api::Error {
        from_tokio_postgres(e, what, &self.table_display())
    }
}

/// The transaction id the insert returned (its first column).
fn xid_of(rows: &[tokio_postgres::Row]) -> std::result::Result<String, tokio_postgres::Error> {
    match rows.first() {
        Some(row) => row.try_get(0),
        // The statements always return one row; treat none as a commit to
        // announce (a wake-up too many costs one empty claim).
        None => Ok(String::new()),
    }
}
