//! Encoding messages into rows and decoding rows back, tolerating corruption.

use std::collections::BTreeMap;

use outbox_api::{Destination, Message, MessageId, MessageKind, MessageState, Timestamp};
use sqlx::Row;
use sqlx::postgres::PgRow;

/// A message's column values, ready to bind (in the order of the inserts).
pub(crate) struct Encoded {
    pub id: uuid::Uuid,
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
            id: m.id.as_uuid(),
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
        self.id.push(e.id);
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

struct Reader<'r> {
    row: &'r PgRow,
    problems: Vec<String>,
}

impl Reader<'_> {
    fn get<T>(&mut self, i: usize, name: &str) -> Option<T>
    where
        T: for<'a> sqlx::Decode<'a, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        match self.row.try_get::<Option<T>, _>(i) {
            Ok(v) => v,
            Err(e) => {
                self.problems.push(format!("column `{name}`: {e}"));
                None
            }
        }
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

    fn text(&mut self, i: usize, name: &str) -> String {
        let value = self.get::<String>(i, name);
        self.required(value, name)
    }

    fn int(&mut self, i: usize, name: &str) -> i64 {
        let value = self.get::<i64>(i, name);
        self.required(value, name)
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
    let mut r = Reader {
        row,
        problems: Vec::new(),
    };
    let id = r
        .get::<uuid::Uuid>(1, "id")
        .map(MessageId::from_uuid)
        .unwrap_or_else(|| MessageId::from_uuid(uuid::Uuid::nil()));
    let kind_text = r.text(2, "kind");
    let kind = kind_text.parse::<MessageKind>().unwrap_or_else(|e| {
        r.problems.push(e.message().to_owned());
        MessageKind::Domain
    });
    let message_type = r.text(3, "message_type");
    let key = r.get::<String>(4, "key");
    let exchange = r.get::<String>(5, "exchange");
    let routing_key = r.get::<String>(6, "routing_key");
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
    let payload = r.get::<Vec<u8>>(7, "payload");
    let payload = r.required(payload, "payload");
    let content_type = r.text(8, "content_type");
    let headers = match r.get::<String>(9, "headers") {
        None => BTreeMap::new(),
        Some(json) => serde_json::from_str::<BTreeMap<String, String>>(&json).unwrap_or_else(|e| {
            r.problems.push(format!(
                "column `headers` is not a JSON object of strings: {e}"
            ));
            BTreeMap::new()
        }),
    };
    let trace_parent = r.get::<String>(10, "trace_parent");
    let created_at = Timestamp::from_millis(r.int(11, "created_at"));
    let available_at = Timestamp::from_millis(r.int(12, "available_at"));
    let attempts_raw = r.get::<i32>(13, "attempts");
    let attempts_raw = r.required(attempts_raw, "attempts");
    let attempts = u32::try_from(attempts_raw).unwrap_or_else(|_| {
        r.problems
            .push(format!("column `attempts` holds {attempts_raw}"));
        0
    });
    let last_error = r.get::<String>(14, "last_error");
    let state_text = r.text(15, "state");
    let state = state_text.parse::<MessageState>().unwrap_or_else(|e| {
        r.problems.push(e.message().to_owned());
        MessageState::Poisoned
    });
    let locked_by = r.get::<String>(16, "locked_by");
    let locked_until = r.get::<i64>(17, "locked_until").map(Timestamp::from_millis);
    let processed_at = r.get::<i64>(18, "processed_at").map(Timestamp::from_millis);
    let problems = r.problems;
    Ok(Decoded {
        seq,
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
