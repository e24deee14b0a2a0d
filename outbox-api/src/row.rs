//! The outbox row, written once for every SQL store: its columns
//! ([`OUTBOX_COLUMNS`]), a message encoded into column values
//! ([`RowValues`]), and a row decoded back ([`decode_row`]) tolerating
//! corruption — every column that cannot be read is noted, so that the row
//! can be poisoned with a note saying what was wrong instead of stopping
//! the relay. Only reading one column's value stays per driver
//! ([`RowColumns`]).

use std::collections::BTreeMap;

use crate::{Destination, Message, MessageId, MessageKind, MessageState, Timestamp};

/// The columns of every outbox table, in the order stores select them
/// (SQLite and PostgreSQL alike); a table lacking any is not an outbox.
pub const OUTBOX_COLUMNS: [&str; 19] = [
    "seq",
    "id",
    "kind",
    "message_type",
    "key",
    "exchange",
    "routing_key",
    "payload",
    "content_type",
    "headers",
    "trace_parent",
    "created_at",
    "available_at",
    "attempts",
    "last_error",
    "state",
    "locked_by",
    "locked_until",
    "processed_at",
];

/// The outbox columns missing from `columns` (the columns a table has,
/// compared without regard to case): empty for an outbox table.
pub fn missing_outbox_columns(columns: &[String]) -> Vec<&'static str> {
    OUTBOX_COLUMNS
        .iter()
        .copied()
        .filter(|c| !columns.iter().any(|have| have.eq_ignore_ascii_case(c)))
        .collect()
}

/// A message's column values for an insert, in the order of
/// [`OUTBOX_COLUMNS`] from `id` to `available_at` (the rest start at their
/// defaults). Times are milliseconds since the epoch; `headers` is a JSON
/// object of strings, or `None` when there are none.
#[derive(Debug, Clone)]
#[allow(missing_docs)] // the fields are the columns of the same names
pub struct RowValues {
    pub id: MessageId,
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

impl RowValues {
    /// The values of `m`.
    pub fn new(m: Message) -> RowValues {
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
        RowValues {
            id: m.id,
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

/// How a driver reads one column of a row, by its position in
/// [`OUTBOX_COLUMNS`]: `Ok(None)` for NULL, `Err` saying what the column
/// holds instead when it is not of the type asked for.
pub trait RowColumns {
    /// A text column.
    fn text(&self, i: usize) -> Result<Option<String>, String>;
    /// An integer column.
    fn int(&self, i: usize) -> Result<Option<i64>, String>;
    /// The payload.
    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String>;
    /// The id (text on SQLite, `uuid` on PostgreSQL).
    fn id(&self, i: usize) -> Result<Option<MessageId>, String>;
}

/// A row read back: the message, with placeholders where a column could
/// not be decoded, and what was wrong.
#[derive(Debug, Clone)]
pub struct DecodedRow {
    /// The message.
    pub message: Message,
    /// What could not be decoded, one entry per column; empty for a sound
    /// row.
    pub problems: Vec<String>,
}

impl DecodedRow {
    /// The message, with any decode problems noted in `last_error` (for
    /// operators).
    pub fn annotated(mut self) -> Message {
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

struct Reader<'r, R: ?Sized> {
    row: &'r R,
    problems: Vec<String>,
}

impl<R: RowColumns + ?Sized> Reader<'_, R> {
    fn column<T>(
        &mut self,
        i: usize,
        read: impl Fn(&R, usize) -> Result<Option<T>, String>,
    ) -> Option<T> {
        match read(self.row, i) {
            Ok(v) => v,
            Err(e) => {
                self.problems
                    .push(format!("column `{}`: {e}", OUTBOX_COLUMNS[i]));
                None
            }
        }
    }

    /// `value`, or a default with a problem noted (unless the column's
    /// problem is already noted).
    fn required<T: Default>(&mut self, value: Option<T>, i: usize) -> T {
        value.unwrap_or_else(|| {
            let name = format!("`{}`", OUTBOX_COLUMNS[i]);
            if !self.problems.iter().any(|p| p.contains(&name)) {
                self.problems.push(format!("column {name} is NULL"));
            }
            T::default()
        })
    }

    fn text(&mut self, i: usize) -> Option<String> {
        self.column(i, R::text)
    }

    fn required_text(&mut self, i: usize) -> String {
        let value = self.text(i);
        self.required(value, i)
    }

    fn int(&mut self, i: usize) -> Option<i64> {
        self.column(i, R::int)
    }

    fn required_int(&mut self, i: usize) -> i64 {
        let value = self.int(i);
        self.required(value, i)
    }
}

/// Decodes a row selected with [`OUTBOX_COLUMNS`] (`seq`, read by the
/// caller, at 0). Never fails: every problem is collected in
/// [`DecodedRow::problems`].
pub fn decode_row<R: RowColumns + ?Sized>(row: &R) -> DecodedRow {
    let mut r = Reader {
        row,
        problems: Vec::new(),
    };
    let id = r.column(1, R::id);
    let id = r.required(id.map(|id| id.as_uuid()), 1);
    let id = MessageId::from_uuid(id);
    let kind_text = r.required_text(2);
    let kind = kind_text.parse::<MessageKind>().unwrap_or_else(|e| {
        r.problems.push(e.message().to_owned());
        MessageKind::Domain
    });
    let message_type = r.required_text(3);
    let key = r.text(4);
    let exchange = r.text(5);
    let routing_key = r.text(6);
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
    let payload = r.column(7, R::bytes);
    let payload = r.required(payload, 7);
    let content_type = r.required_text(8);
    let headers = match r.text(9) {
        None => BTreeMap::new(),
        Some(json) => serde_json::from_str::<BTreeMap<String, String>>(&json).unwrap_or_else(|e| {
            r.problems.push(format!(
                "column `headers` is not a JSON object of strings: {e}"
            ));
            BTreeMap::new()
        }),
    };
    let trace_parent = r.text(10);
    let created_at = Timestamp::from_millis(r.required_int(11));
    let available_at = Timestamp::from_millis(r.required_int(12));
    let attempts_raw = r.required_int(13);
    let attempts = u32::try_from(attempts_raw).unwrap_or_else(|_| {
        r.problems
            .push(format!("column `attempts` holds {attempts_raw}"));
        0
    });
    let last_error = r.text(14);
    let state_text = r.required_text(15);
    let state = state_text.parse::<MessageState>().unwrap_or_else(|e| {
        r.problems.push(e.message().to_owned());
        MessageState::Poisoned
    });
    let locked_by = r.text(16);
    let locked_until = r.int(17).map(Timestamp::from_millis);
    let processed_at = r.int(18).map(Timestamp::from_millis);
    DecodedRow {
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
        problems: r.problems,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NewMessage;

    /// A row as plain cells.
    struct Cells(Vec<Cell>);

    #[derive(Clone)]
    enum Cell {
        Null,
        Text(&'static str),
        Int(i64),
        Bytes(Vec<u8>),
    }

    impl RowColumns for Cells {
        fn text(&self, i: usize) -> Result<Option<String>, String> {
            match &self.0[i] {
                Cell::Null => Ok(None),
                Cell::Text(t) => Ok(Some((*t).to_owned())),
                _ => Err("not text".into()),
            }
        }
        fn int(&self, i: usize) -> Result<Option<i64>, String> {
            match &self.0[i] {
                Cell::Null => Ok(None),
                Cell::Int(v) => Ok(Some(*v)),
                _ => Err("not an integer".into()),
            }
        }
        fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String> {
            match &self.0[i] {
                Cell::Null => Ok(None),
                Cell::Bytes(b) => Ok(Some(b.clone())),
                _ => Err("not bytes".into()),
            }
        }
        fn id(&self, i: usize) -> Result<Option<MessageId>, String> {
            match &self.0[i] {
                Cell::Null => Ok(None),
                Cell::Text(t) => t
                    .parse()
                    .map(Some)
                    .map_err(|_| format!("`{t}` is not a UUID")),
                _ => Err("not text".into()),
            }
        }
    }

    fn sound(id: &'static str) -> Vec<Cell> {
        use Cell::*;
        vec![
            Int(7),
            Text(id),
            Text("integration"),
            Text("OrderPlaced"),
            Text("order-1"),
            Text("shop"),
            Text("orders"),
            Bytes(b"{}".to_vec()),
            Text("application/json"),
            Text(r#"{"a":"b"}"#),
            Null,
            Int(1_000),
            Int(2_000),
            Int(1),
            Null,
            Text("pending"),
            Null,
            Null,
            Null,
        ]
    }

    #[test]
    fn a_sound_row_decodes_and_an_encoded_message_reads_back() {
        let id = "01890a5d-ac96-774b-bcce-b302099a8057";
        let d = decode_row(&Cells(sound(id)));
        assert!(d.problems.is_empty(), "{:?}", d.problems);
        assert_eq!(d.message.id.to_string(), id);
        assert_eq!(
            d.message.destination.as_ref().unwrap().routing_key,
            "orders"
        );
        assert_eq!(d.message.headers["a"], "b");
        assert_eq!(d.message.attempts, 1);

        let m = NewMessage::new(MessageKind::Domain, "Ping", b"x".to_vec())
            .into_message(Timestamp::from_millis(5))
            .unwrap();
        let v = RowValues::new(m.clone());
        assert_eq!((v.id, v.kind, v.created_at), (m.id, "domain", 5));
        assert_eq!(v.headers, None, "no headers: NULL");
    }

    #[test]
    fn a_corrupt_row_decodes_with_every_problem_named() {
        let mut cells = sound("not-a-uuid");
        cells[2] = Cell::Text("carrier-pigeon");
        cells[7] = Cell::Null;
        cells[9] = Cell::Text("[1]");
        cells[13] = Cell::Int(-1);
        cells[15] = Cell::Int(3);
        let d = decode_row(&Cells(cells));
        let all = d.problems.join(" | ");
        for expected in [
            "column `id`: `not-a-uuid` is not a UUID",
            "carrier-pigeon",
            "column `payload` is NULL",
            "column `headers` is not a JSON object",
            "column `attempts` holds -1",
            "column `state`: not text",
        ] {
            assert!(all.contains(expected), "{expected} in {all}");
        }
        assert_eq!(d.message.state, MessageState::Poisoned);
        let note = d.annotated().last_error.unwrap();
        assert!(note.starts_with("corrupt row: "), "{note}");
    }
}
