//! Reading a SQLite row's columns for the shared row codec
//! ([`outbox_api::backend::decode_row`]); encoding is
//! [`outbox_api::backend::RowValues`].

use outbox_api::backend::{RowColumns, decode_row};
use outbox_api::{Message, MessageId};
use rusqlite::types::{Value, ValueRef};

pub(crate) use outbox_api::backend::RowValues as Encoded;

/// A row read back: its `seq`, its raw `key` value, the message (with
/// placeholders where a column could not be decoded) and what was wrong.
pub(crate) struct Decoded {
    pub seq: i64,
    pub raw_key: Value,
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

/// A rusqlite row as [`RowColumns`].
struct Columns<'r, 's>(&'r rusqlite::Row<'s>);

impl Columns<'_, '_> {
    fn value(&self, i: usize) -> Result<ValueRef<'_>, String> {
        self.0.get_ref(i).map_err(|e| e.to_string())
    }
}

fn holds(v: ValueRef<'_>, wanted: &str) -> String {
    format!("holds {:?}, not {wanted}", v.data_type())
}

impl RowColumns for Columns<'_, '_> {
    fn text(&self, i: usize) -> Result<Option<String>, String> {
        match self.value(i)? {
            ValueRef::Null => Ok(None),
            ValueRef::Text(t) => std::str::from_utf8(t)
                .map(|s| Some(s.to_owned()))
                .map_err(|e| format!("is not UTF-8: {e}")),
            other => Err(holds(other, "text")),
        }
    }

    fn int(&self, i: usize) -> Result<Option<i64>, String> {
        match self.value(i)? {
            ValueRef::Null => Ok(None),
            ValueRef::Integer(v) => Ok(Some(v)),
            other => Err(holds(other, "an integer")),
        }
    }

    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String> {
        match self.value(i)? {
            ValueRef::Null => Ok(None),
            ValueRef::Blob(b) | ValueRef::Text(b) => Ok(Some(b.to_vec())),
            other => Err(holds(other, "bytes")),
        }
    }

    fn id(&self, i: usize) -> Result<Option<MessageId>, String> {
        match self.text(i)? {
            None => Ok(None),
            Some(t) => t
                .parse()
                .map(Some)
                .map_err(|_| format!("`{}` is not a UUID", t.escape_debug())),
        }
    }
}

/// Decodes a row selected with `schema::COLUMNS`. Only `seq` and the raw
/// key must read; every other problem is collected, so that the row can be
/// poisoned with a note saying what was wrong.
pub(crate) fn decode(row: &rusqlite::Row<'_>) -> rusqlite::Result<Decoded> {
    let seq: i64 = row.get(0)?;
    let raw_key: Value = row.get(4)?;
    let decoded = decode_row(&Columns(row));
    Ok(Decoded {
        seq,
        raw_key,
        message: decoded.message,
        problems: decoded.problems,
    })
}
