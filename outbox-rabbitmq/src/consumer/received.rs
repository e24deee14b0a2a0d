//! Decoding an AMQP delivery into a [`Received`].

use std::collections::BTreeMap;

use lapin::message::Delivery;
use lapin::types::AMQPValue;
use outbox_api::receive::Received;
use outbox_api::{MessageId, Timestamp};

use crate::transport::{KEY_HEADER, TRACEPARENT_HEADER};

/// Decodes an AMQP delivery; `Err` says why it cannot be handled.
pub(super) fn decode(d: &Delivery) -> std::result::Result<Received, String> {
    let p = &d.properties;
    let raw_id = p
        .message_id()
        .as_ref()
        .ok_or_else(|| "the delivery has no message_id".to_owned())?;
    let id: MessageId = raw_id.as_str().parse().map_err(|_| {
        format!(
            "message_id `{}` is not a message id (UUID)",
            raw_id.as_str().chars().take(80).collect::<String>()
        )
    })?;
    let mut headers = BTreeMap::new();
    if let Some(table) = p.headers() {
        for (name, value) in table.inner() {
            if let Some(text) = header_text(value) {
                headers.insert(name.as_str().to_owned(), text);
            }
        }
    }
    let mut r = Received::new(id, d.data.clone());
    r.message_type = p.kind().as_ref().map(|s| s.as_str().to_owned());
    r.key = headers.get(KEY_HEADER).cloned();
    r.trace_parent = headers.get(TRACEPARENT_HEADER).cloned();
    r.headers = headers;
    r.content_type = p.content_type().as_ref().map(|s| s.as_str().to_owned());
    r.timestamp = p
        .timestamp()
        .and_then(|t| i64::try_from(t).ok())
        .map(|secs| Timestamp::from_millis(secs.saturating_mul(1000)));
    r.exchange = d.exchange.as_str().to_owned();
    r.routing_key = d.routing_key.as_str().to_owned();
    r.redelivered = d.redelivered;
    Ok(r)
}

fn header_text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use lapin::types::{FieldTable, LongString, ShortString};

    use super::*;

    #[test]
    fn decodes_a_delivery() {
        let id = MessageId::new();
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from(TRACEPARENT_HEADER),
            AMQPValue::LongString(LongString::from(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )),
        );
        headers.insert(
            ShortString::from(KEY_HEADER),
            AMQPValue::LongString(LongString::from("order-1")),
        );
        headers.insert(ShortString::from("n"), AMQPValue::LongInt(7));
        let mut d = Delivery::mock(1, "x".into(), "rk".into(), true, b"{}".to_vec());
        d.properties = lapin::BasicProperties::default()
            .with_message_id(ShortString::from(id.to_string()))
            .with_type(ShortString::from("OrderPlaced"))
            .with_timestamp(5)
            .with_headers(headers);
        let r = decode(&d).unwrap();
        assert_eq!(r.id, id);
        assert_eq!(r.message_type.as_deref(), Some("OrderPlaced"));
        assert_eq!(r.key.as_deref(), Some("order-1"));
        assert!(r.trace_parent.as_deref().unwrap().contains("0af7651916cd"));
        assert_eq!(r.header("n"), Some("7"));
        assert_eq!(r.timestamp, Some(Timestamp::from_millis(5000)));
        assert!(r.redelivered);
        assert_eq!((r.exchange.as_str(), r.routing_key.as_str()), ("x", "rk"));

        let mut bad = Delivery::mock(2, "".into(), "q".into(), false, vec![]);
        assert!(decode(&bad).unwrap_err().contains("no message_id"));
        bad.properties = lapin::BasicProperties::default().with_message_id("nope".into());
        assert!(decode(&bad).unwrap_err().contains("not a message id"));
    }
}
