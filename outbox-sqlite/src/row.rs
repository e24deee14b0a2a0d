//! Encoding messages into rows and decoding rows back, tolerating corruption.

use std::collections::BTreeMap;

use outbox_api::{Destination, Message, MessageId, MessageKind, MessageState, Timestamp};
use rusqlite::types::{Value, ValueRef};

/// A message's column values, ready to bind (same order as `Sql::insert`).
pub(crate) struct Encoded {
    pub id: String,
    pub kind: &'static str,
    pub message_type: String,
    pub key: Option<String>,
    pub exchange: Option<String>,
    pub routing_key: Option<String>,
    pub payload: Vec<u8>,
    pub content_type: String,
    pub headers: Option<String>,
    pub trace_parent: Option<String>,
    pub created_at: i64,
    pub available_at: i64,
}

impl Encoded {
    pub(crate) fn new(m: Message) -> Encoded {
        let headers = if m.headers.is_empty() {
            None
        } else {
            // A map of strings always serialises.
            Some(serde_json::to_string(&m.headers).unwrap_or_else(|_| "{}".to_owned()))
        };
        let (exchange, routing_key) = match m.destination {
            Some(d) => (Some(d.exchange), Some(d.routing_key)),
            None => (None, None),
        };
        Encoded {
            id: m.id.to_string(),
            kind: m.kind.as_str(),
            message_type: m.message_type,
            key: m.key,
            exchange,
            routing_key,
            payload: m.payload,
            content_type: m.content_type,
            headers,
            trace_parent: m.trace_parent,
            created_at: m.created_at.as_millis(),
            available_at: m.available_at.as_millis(),
        }
    }
}

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
    pub(crate) fn annotated(mut self) -> Message {
        if !self.problems.is_empty() {
            let note = format!("corrupt row: {}", self.problems.join("; "));
            self.message.last_error = Some(match self.message.last_error.take() {
                Some(prev) if !prev.contains(&note) => format!("{note}; {prev}"),
                Some(prev) => prev,
                None => note,
            });
        }
        self.message
    }
}

struct Reader<'r, 's> {
    row: &'r rusqlite::Row<'s>,
    problems: Vec<String>,
}

impl Reader<'_, '_> {
    fn text(&mut self, i: usize, name: &str) -> Option<String> {
        match self.row.get_ref(i) {
            Ok(ValueRef::Null) => None,
            Ok(ValueRef::Text(t)) => match std::str::from_utf8(t) {
                Ok(s) => Some(s.to_owned()),
                Err(e) => {
                    self.problems
                        .push(format!("column `{name}` is not UTF-8: {e}"));
                    None
                }
            },
            Ok(other) => {
                self.problems.push(format!(
                    "column `{name}` holds {:?}, not text",
                    other.data_type()
                ));
                None
            }
            Err(e) => {
                self.problems.push(format!("column `{name}`: {e}"));
                None
            }
        }
    }

    fn required_text(&mut self, i: usize, name: &str) -> String {
        let value = self.text(i, name);
        self.required(value, name)
    }

    /// `value`, or a default with a problem noted (unless the column's
    /// problem is already noted).
    fn required<T: Default>(&mut self, value: Option<T>, name: &str) -> T {
        value.unwrap_or_else(|| {
            if !self
                .problems
                .iter()
                .any(|p| p.contains(&format!("`{name}`")))
            {
                self.problems.push(format!("column `{name}` is NULL"));
            }
            T::default()
        })
    }

    fn int(&mut self, i: usize, name: &str) -> Option<i64> {
        match self.row.get_ref(i) {
            Ok(ValueRef::Null) => None,
            Ok(ValueRef::Integer(v)) => Some(v),
            Ok(other) => {
                self.problems.push(format!(
                    "column `{name}` holds {:?}, not an integer",
                    other.data_type()
                ));
                None
            }
            Err(e) => {
                self.problems.push(format!("column `{name}`: {e}"));
                None
            }
        }
    }

    fn required_int(&mut self, i: usize, name: &str) -> i64 {
        let value = self.int(i, name);
        self.required(value, name)
    }
}

/// Decodes a row selected with `schema::COLUMNS`.
pub(crate) fn decode(row: &rusqlite::Row<'_>) -> rusqlite::Result<Decoded> {
    let seq: i64 = row.get(0)?;
    let raw_key: Value = row.get(4)?;
    let mut r = Reader {
        row,
        problems: Vec::new(),
    };
    let id_text = r.required_text(1, "id");
    let id = match id_text.parse::<MessageId>() {
        Ok(id) => id,
        Err(_) => {
            if !id_text.is_empty() {
                r.problems
                    .push(format!("id `{}` is not a UUID", id_text.escape_debug()));
            }
            MessageId::from_uuid(uuid::Uuid::nil())
        }
    };
    let kind_text = r.required_text(2, "kind");
    let kind = kind_text.parse::<MessageKind>().unwrap_or_else(|e| {
        r.problems.push(e.message().to_owned());
        MessageKind::Domain
    });
    let message_type = r.required_text(3, "message_type");
    let key = r.text(4, "key");
    let exchange = r.text(5, "exchange");
    let routing_key = r.text(6, "routing_key");
    let destination = match (exchange, routing_key) {
        (Some(exchange), Some(routing_key)) => Some(Destination {
            exchange,
            routing_key,
        }),
        (None, None) => None,
        _ => {
            r.problems
                .push("only one of `exchange` and `routing_key` is set".to_owned());
            None
        }
    };
    let payload = match row.get_ref(7) {
        Ok(ValueRef::Blob(b)) => b.to_vec(),
        Ok(ValueRef::Text(t)) => t.to_vec(),
        Ok(ValueRef::Null) => {
            r.problems.push("column `payload` is NULL".to_owned());
            Vec::new()
        }
        Ok(other) => {
            r.problems.push(format!(
                "column `payload` holds {:?}, not bytes",
                other.data_type()
            ));
            Vec::new()
        }
        Err(e) => {
            r.problems.push(format!("column `payload`: {e}"));
            Vec::new()
        }
    };
    let content_type = r.required_text(8, "content_type");
    let headers = match r.text(9, "headers") {
        None => BTreeMap::new(),
        Some(json) => serde_json::from_str::<BTreeMap<String, String>>(&json).unwrap_or_else(|e| {
            r.problems.push(format!(
                "column `headers` is not a JSON object of strings: {e}"
            ));
            BTreeMap::new()
        }),
    };
    let trace_parent = r.text(10, "trace_parent");
    let created_at = Timestamp::from_millis(r.required_int(11, "created_at"));
    let available_at = Timestamp::from_millis(r.required_int(12, "available_at"));
    let attempts_raw = r.required_int(13, "attempts");
    let attempts = u32::try_from(attempts_raw).unwrap_or_else(|_| {
        r.problems
            .push(format!("column `attempts` holds {attempts_raw}"));
        0
    });
    let last_error = r.text(14, "last_error");
    let state_text = r.required_text(15, "state");
    let state = state_text.parse::<MessageState>().unwrap_or_else(|e| {
        r.problems.push(e.message().to_owned());
        MessageState::Poisoned
    });
    let locked_by = r.text(16, "locked_by");
    let locked_until = r.int(17, "locked_until").map(Timestamp::from_millis);
    let processed_at = r.int(18, "processed_at").map(Timestamp::from_millis);
    let problems = r.problems;
    Ok(Decoded {
        seq,
        raw_key,
        message: Message {
            id,
            kind,
            message_type,
            key,
            destination,
            payload,
            content_type,
            headers,
            trace_parent,
            created_at,
            available_at,
            attempts,
            last_error,
            state,
            locked_by,
            locked_until,
            processed_at,
        },
        problems,
    })
}
