//! [`Received`]: a delivery decoded into a message.

use std::collections::BTreeMap;

use lapin::message::Delivery;
use lapin::types::AMQPValue;
use outbox_api::{Error, MessageId, Result, Timestamp};

use crate::transport::{KEY_HEADER, TRACEPARENT_HEADER};

/// A message received from RabbitMQ, decoded from the AMQP delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Received {
    /// The AMQP `message_id`, parsed: the sender's outbox id and the inbox key.
    pub id: MessageId,
    /// The AMQP `type` (the outbox `message_type`), if set.
    pub message_type: Option<String>,
    /// The ordering key (header `x-outbox-key`), if any.
    pub key: Option<String>,
    /// The W3C `traceparent` header of the span that enqueued the message, if any.
    pub trace_parent: Option<String>,
    /// Every header whose value is a string or a scalar (numbers and booleans
    /// as text), including `traceparent` and `x-outbox-key`.
    pub headers: BTreeMap<String, String>,
    /// The AMQP `content_type`, if set.
    pub content_type: Option<String>,
    /// The body, unchanged.
    pub payload: Vec<u8>,
    /// The AMQP `timestamp` (seconds precision), if set.
    pub timestamp: Option<Timestamp>,
    /// The exchange it was published to (`""`: the default exchange).
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Whether the broker delivered it before (to this or another consumer).
    /// A retry in place is not a redelivery: it keeps the broker's flag.
    pub redelivered: bool,
    /// Which try of this consumer process this is (1 the first time; counts
    /// handler failures, not outages, see
    /// [`RabbitConsumerBuilder::max_attempts`](crate::RabbitConsumerBuilder::max_attempts)).
    pub attempt: u32,
}

impl Received {
    /// Decodes the JSON payload.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.payload).map_err(|e| {
            Error::invalid_input(format!(
                "payload of received message {} (type `{}`) does not decode as {}: {e}",
                self.id,
                self.message_type.as_deref().unwrap_or(""),
                std::any::type_name::<T>()
            ))
        })
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

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
        Ok(Received {
            id,
            message_type: p.kind().as_ref().map(|s| s.as_str().to_owned()),
            key: headers.get(KEY_HEADER).cloned(),
            trace_parent: headers.get(TRACEPARENT_HEADER).cloned(),
            headers,
            content_type: p.content_type().as_ref().map(|s| s.as_str().to_owned()),
            payload: d.data.clone(),
            timestamp: p
                .timestamp()
                .and_then(|t| i64::try_from(t).ok())
                .map(|secs| Timestamp::from_millis(secs.saturating_mul(1000))),
            exchange: d.exchange.as_str().to_owned(),
            routing_key: d.routing_key.as_str().to_owned(),
            redelivered: d.redelivered,
            attempt: 1,
        })
    }
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
        let r = Received::decode(&d).unwrap();
        assert_eq!(r.id, id);
        assert_eq!(r.message_type.as_deref(), Some("OrderPlaced"));
        assert_eq!(r.key.as_deref(), Some("order-1"));
        assert!(r.trace_parent.as_deref().unwrap().contains("0af7651916cd"));
        assert_eq!(r.header("n"), Some("7"));
        assert_eq!(r.timestamp, Some(Timestamp::from_millis(5000)));
        assert!(r.redelivered);
        assert_eq!((r.exchange.as_str(), r.routing_key.as_str()), ("x", "rk"));

        let mut bad = Delivery::mock(2, "".into(), "q".into(), false, vec![]);
        assert!(
            Received::decode(&bad)
                .unwrap_err()
                .contains("no message_id")
        );
        bad.properties = lapin::BasicProperties::default().with_message_id("nope".into());
        assert!(
            Received::decode(&bad)
                .unwrap_err()
                .contains("not a message id")
        );
    }
}
