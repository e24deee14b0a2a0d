//! How messages look: JSON objects for `--json`, a table for `list`, a
//! field-by-field page for `show`.

use std::fmt::Write as _;

use outbox_api::{Message, Timestamp};
use serde_json::{Value, json};

/// Longest `last_error` shown in a `list` row, in characters.
const ERROR_WIDTH: usize = 60;
/// Longest type or key shown in a `list` row, in characters.
const NAME_WIDTH: usize = 32;

/// A payload, decoded for display.
#[derive(Debug)]
pub enum Payload {
    /// Valid JSON.
    Json(Value),
    /// Not JSON, but valid UTF-8.
    Text(String),
    /// Neither: shown as hex.
    Binary(Vec<u8>),
}

impl Payload {
    /// Classifies raw payload bytes.
    pub fn decode(bytes: &[u8]) -> Payload {
        if let Ok(value) = serde_json::from_slice::<Value>(bytes) {
            return Payload::Json(value);
        }
        match std::str::from_utf8(bytes) {
            Ok(text) => Payload::Text(text.to_owned()),
            Err(_) => Payload::Binary(bytes.to_vec()),
        }
    }

    /// `"json"`, `"utf8"` or `"hex"`.
    pub fn encoding(&self) -> &'static str {
        match self {
            Payload::Json(_) => "json",
            Payload::Text(_) => "utf8",
            Payload::Binary(_) => "hex",
        }
    }
}

/// Replaces control characters (newlines too) by escapes, so that stored
/// text cannot break a table row or send escape sequences to the terminal.
pub fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Like [`one_line`] but keeps newlines and tabs (multi-line payloads).
fn multi_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() && c != '\n' && c != '\t' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Shortens `text` to `max` characters, ending it with `…` if cut.
pub fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

fn ts(t: Option<Timestamp>) -> Value {
    t.map_or(Value::Null, |t| Value::String(t.to_string()))
}

/// A message as JSON; with `payload`, the payload is included (embedded as
/// JSON when it is JSON, else as a UTF-8 or hex string, see
/// `payload_encoding`).
pub fn message_json(m: &Message, payload: bool) -> Value {
    let mut v = json!({
        "id": m.id.to_string(),
        "state": m.state.as_str(),
        "kind": m.kind.as_str(),
        "message_type": m.message_type,
        "key": m.key,
        "destination": m.destination.as_ref().map(|d| json!({
            "exchange": d.exchange,
            "routing_key": d.routing_key,
        })),
        "content_type": m.content_type,
        "headers": m.headers,
        "trace_parent": m.trace_parent,
        "created_at": m.created_at.to_string(),
        "available_at": m.available_at.to_string(),
        "processed_at": ts(m.processed_at),
        "attempts": m.attempts,
        "last_error": m.last_error,
        "locked_by": m.locked_by,
        "locked_until": ts(m.locked_until),
        "payload_size": m.payload.len(),
    });
    if payload {
        let decoded = Payload::decode(&m.payload);
        v["payload_encoding"] = Value::from(decoded.encoding());
        v["payload"] = match decoded {
            Payload::Json(value) => value,
            Payload::Text(text) => Value::String(text),
            Payload::Binary(bytes) => Value::String(hex(&bytes)),
        };
    }
    v
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A hex dump: offset, 16 bytes a line.
fn hex_dump(bytes: &[u8]) -> String {
    let mut out = String::new();
    for (i, chunk) in bytes.chunks(16).enumerate() {
        let _ = write!(out, "{:08x} ", i * 16);
        for b in chunk {
            let _ = write!(out, " {b:02x}");
        }
        out.push('\n');
    }
    out
}

/// The `list` table: one row per message, columns padded to fit.
pub fn message_table(messages: &[Message]) -> String {
    let header = [
        "ID",
        "STATE",
        "TYPE",
        "KEY",
        "ATTEMPTS",
        "CREATED_AT",
        "LAST_ERROR",
    ];
    let rows: Vec<[String; 7]> = messages
        .iter()
        .map(|m| {
            [
                m.id.to_string(),
                m.state.as_str().to_owned(),
                truncate(&one_line(&m.message_type), NAME_WIDTH),
                truncate(&one_line(m.key.as_deref().unwrap_or("-")), NAME_WIDTH),
                m.attempts.to_string(),
                m.created_at.to_string(),
                truncate(
                    &one_line(m.last_error.as_deref().unwrap_or("-")),
                    ERROR_WIDTH,
                ),
            ]
        })
        .collect();
    table(&header, &rows)
}

/// A table: the header, then one line per row, each column padded to its
/// widest cell (the last one not padded). Cells must be one line already
/// ([`one_line`]).
pub fn table<R: AsRef<[String]>>(header: &[&str], rows: &[R]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row.as_ref()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            text.push_str(cell);
            if i + 1 < cells.len() {
                let pad = w - cell.chars().count();
                text.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&header.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>());
    for row in rows {
        line(row.as_ref());
    }
    out
}

/// The `show` page: every field, headers, and the payload.
pub fn message_page(m: &Message) -> String {
    let opt = |v: Option<&str>| v.map_or_else(|| "-".to_owned(), one_line);
    let opt_ts = |t: Option<Timestamp>| t.map_or_else(|| "-".to_owned(), |t| t.to_string());
    let destination = m.destination.as_ref().map_or_else(
        || "-".to_owned(),
        |d| {
            format!(
                "exchange `{}`, routing key `{}`",
                one_line(&d.exchange),
                one_line(&d.routing_key)
            )
        },
    );
    let fields = [
        ("id", m.id.to_string()),
        ("state", m.state.as_str().to_owned()),
        ("kind", m.kind.as_str().to_owned()),
        ("type", one_line(&m.message_type)),
        ("key", opt(m.key.as_deref())),
        ("destination", destination),
        ("content type", one_line(&m.content_type)),
        ("created at", m.created_at.to_string()),
        ("available at", m.available_at.to_string()),
        ("processed at", opt_ts(m.processed_at)),
        ("attempts", m.attempts.to_string()),
        ("locked by", opt(m.locked_by.as_deref())),
        ("locked until", opt_ts(m.locked_until)),
        ("trace parent", opt(m.trace_parent.as_deref())),
        ("last error", opt(m.last_error.as_deref())),
    ];
    let mut out = String::new();
    for (name, value) in fields {
        let _ = writeln!(out, "{:<14}{value}", format!("{name}:"));
    }
    if m.headers.is_empty() {
        out.push_str("headers:      -\n");
    } else {
        out.push_str("headers:\n");
        for (name, value) in &m.headers {
            let _ = writeln!(out, "  {}: {}", one_line(name), one_line(value));
        }
    }
    let payload = Payload::decode(&m.payload);
    let _ = writeln!(
        out,
        "payload:      {} bytes, shown as {}",
        m.payload.len(),
        payload.encoding()
    );
    let body = match payload {
        Payload::Json(value) => {
            serde_json::to_string_pretty(&value).unwrap_or_else(|_| value.to_string()) + "\n"
        }
        Payload::Text(text) => {
            let mut text = multi_line(&text);
            if !text.ends_with('\n') && !text.is_empty() {
                text.push('\n');
            }
            text
        }
        Payload::Binary(bytes) => hex_dump(&bytes),
    };
    out.push_str(&body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_classified() {
        assert_eq!(Payload::decode(br#"{"a":1}"#).encoding(), "json");
        assert_eq!(Payload::decode(b"hello").encoding(), "utf8");
        assert_eq!(Payload::decode(&[0xff, 0x00]).encoding(), "hex");
        assert_eq!(Payload::decode(b"").encoding(), "utf8");
    }

    #[test]
    fn text_is_made_safe_and_short() {
        assert_eq!(one_line("a\nb\x1b[31m"), "a\\nb\\u{1b}[31m");
        assert_eq!(truncate("abcdef", 4), "abc…");
        assert_eq!(truncate("abc", 4), "abc");
        assert_eq!(hex_dump(&[1, 2]), "00000000  01 02\n");
    }
}
