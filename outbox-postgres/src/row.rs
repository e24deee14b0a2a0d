//! Reading a PostgreSQL row's columns for the shared row codec
//! ([`outbox_api::backend::decode_row`]), and many messages' values as one
//! array per column for `insert_many`; a message's values are
//! [`outbox_api::backend::RowValues`].

use outbox_api::backend::{RowColumns, decode_row};
use outbox_api::{Message, MessageId};
use sqlx::postgres::PgRow;
use sqlx::{Column, Row, TypeInfo};

pub(crate) use outbox_api::backend::RowValues as Encoded;

/// Many messages' columns, one array per column, for `insert_many`.
#[derive(Default)]
pub(crate) struct EncodedColumns {
    pub id: Vec<uuid::Uuid>,
    pub kind: Vec<&'static str>,
    pub message_type: Vec<String>,
    pub key: Vec<Option<String>>,
    pub exchange: Vec<Option<String>>,
    pub routing_key: Vec<Option<String>>,
    pub payload: Vec<Vec<u8>>,
    pub content_type: Vec<String>,
    pub headers: Vec<Option<String>>,
    pub trace_parent: Vec<Option<String>>,
    pub created_at: Vec<i64>,
    pub available_at: Vec<i64>,
}

impl EncodedColumns {
    pub(crate) fn push(&mut self, e: Encoded) {
        self.id.push(e.id.as_uuid());
        self.kind.push(e.kind);
        self.message_type.push(e.message_type);
        self.key.push(e.key);
        self.exchange.push(e.exchange);
        self.routing_key.push(e.routing_key);
        self.payload.push(e.payload);
        self.content_type.push(e.content_type);
        self.headers.push(e.headers);
        self.trace_parent.push(e.trace_parent);
        self.created_at.push(e.created_at);
        self.available_at.push(e.available_at);
    }
}

/// A row read back: its `seq`, the message (with placeholders where a
/// column could not be decoded) and what was wrong.
pub(crate) struct Decoded {
    pub seq: i64,
    pub message: Message,
    pub problems: Vec<String>,
}

impl Decoded {
    /// The message, with any decode problems noted in `last_error` (for operators).
    pub(crate) fn annotated(self) -> Message {
        outbox_api::backend::DecodedRow {
            message: self.message,
            problems: self.problems,
        }
        .annotated()
    }
}

/// A PostgreSQL row as [`RowColumns`].
struct Columns<'r>(&'r PgRow);

impl Columns<'_> {
    fn get<T>(&self, i: usize) -> Result<Option<T>, String>
    where
        T: for<'a> sqlx::Decode<'a, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        self.0.try_get::<Option<T>, _>(i).map_err(|e| e.to_string())
    }
}

impl RowColumns for Columns<'_> {
    fn text(&self, i: usize) -> Result<Option<String>, String> {
        self.get(i)
    }

    fn int(&self, i: usize) -> Result<Option<i64>, String> {
        // `attempts` is an `integer`, the times `bigint`: read each as what
        // it is (a failed read costs an error's allocation, on every row).
        let int4 = self
            .0
            .columns()
            .get(i)
            .is_some_and(|c| c.type_info().name() == "INT4");
        if int4 {
            self.get::<i32>(i).map(|v| v.map(i64::from))
        } else {
            self.get::<i64>(i)
        }
    }

    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String> {
        self.get(i)
    }

    fn id(&self, i: usize) -> Result<Option<MessageId>, String> {
        self.get::<uuid::Uuid>(i)
            .map(|id| id.map(MessageId::from_uuid))
    }
}

/// For operator reads: the message of a row, annotated with its problems.
pub(crate) fn decode_annotated(row: &PgRow) -> Result<Message, sqlx::Error> {
    Ok(decode(row)?.annotated())
}

/// Decodes a row selected with `schema::COLUMNS`. Only `seq` must decode;
/// every other problem is collected, so that the row can be poisoned with a
/// note saying what was wrong.
pub(crate) fn decode(row: &PgRow) -> Result<Decoded, sqlx::Error> {
    let seq: i64 = row.try_get(0)?;
    let decoded = decode_row(&Columns(row));
    Ok(Decoded {
        seq,
        message: decoded.message,
        problems: decoded.problems,
    })
}
