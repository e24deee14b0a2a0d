//! Reading a MySQL row's columns for the shared row codec
//! ([`outbox_api::backend::decode_row`]); a message's values for an insert
//! are [`outbox_api::backend::RowValues`].

use outbox_api::backend::{DecodedRow, RowColumns, decode_row};
use outbox_api::{Message, MessageId};
use sqlx::Row;
use sqlx::mysql::MySqlRow;

pub(crate) use outbox_api::backend::RowValues as Encoded;

/// A row read back: its `seq` and the decoded message with its problems.
pub(crate) struct Decoded {
    pub seq: i64,
    pub row: DecodedRow,
}

/// A MySQL row as [`RowColumns`].
struct Columns<'r>(&'r MySqlRow);

impl Columns<'_> {
    fn get<T>(&self, i: usize) -> Result<Option<T>, String>
    where
        T: for<'a> sqlx::Decode<'a, sqlx::MySql> + sqlx::Type<sqlx::MySql>,
    {
        self.0.try_get::<Option<T>, _>(i).map_err(|e| e.to_string())
    }
}

impl RowColumns for Columns<'_> {
    fn text(&self, i: usize) -> Result<Option<String>, String> {
        match self.get::<String>(i) {
            Ok(v) => Ok(v),
            // `key` is VARBINARY: bytes, which must be UTF-8.
            Err(_) => match self.get::<Vec<u8>>(i)? {
                None => Ok(None),
                Some(bytes) => String::from_utf8(bytes)
                    .map(Some)
                    .map_err(|_| "not UTF-8 text".to_owned()),
            },
        }
    }

    fn int(&self, i: usize) -> Result<Option<i64>, String> {
        self.get::<i64>(i)
            .or_else(|_| self.get::<i32>(i).map(|v| v.map(i64::from)))
    }

    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String> {
        self.get(i)
    }

    fn id(&self, i: usize) -> Result<Option<MessageId>, String> {
        self.get::<uuid::Uuid>(i)
            .map(|id| id.map(MessageId::from_uuid))
    }
}

/// Decodes a row selected with `schema::columns`. Only `seq` must decode;
/// every other problem is collected, so that the row can be poisoned with a
/// note saying what was wrong.
pub(crate) fn decode(row: &MySqlRow) -> Result<Decoded, sqlx::Error> {
    Ok(Decoded {
        seq: row.try_get(0)?,
        row: decode_row(&Columns(row)),
    })
}

/// For operator reads: the message of a row, annotated with its problems.
pub(crate) fn decode_annotated(row: &MySqlRow) -> Result<Message, sqlx::Error> {
    Ok(decode(row)?.row.annotated())
}
