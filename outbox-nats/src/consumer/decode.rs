//! Decoding a JetStream message into a [`Received`].

use std::collections::BTreeMap;

use async_nats::HeaderMap;
use async_nats::jetstream;
use outbox_api::receive::Received;
use outbox_api::{MessageId, Timestamp};

use crate::transport::{
    CONTENT_TYPE_HEADER, CREATED_AT_HEADER, KEY_HEADER, MSG_ID_HEADER, TRACEPARENT_HEADER,
    TYPE_HEADER,
};

/// The headers as text (a header's first value).
pub(super) fn text_headers(h: &HeaderMap) -> BTreeMap<String, String> {
    h.iter()
        .filter_map(|(name, values)| {
            values
                .first()
                .map(|v| (name.to_string(), v.as_str().to_owned()))
        })
        .collect()
}

/// Decodes a JetStream message; `Err` says why it cannot be handled.
pub(super) fn decode(
    m: &jetstream::Message,
    stream: &str,
    redelivered: bool,
) -> std::result::Result<Received, String> {
    let headers = m.headers.as_ref().map(text_headers).unwrap_or_default();
    let raw = headers
        .get(MSG_ID_HEADER)
        .ok_or_else(|| format!("the message has no {MSG_ID_HEADER} header"))?;
    let id: MessageId = raw.parse().map_err(|_| {
        format!(
            "{MSG_ID_HEADER} `{}` is not a message id (UUID)",
            raw.chars().take(80).collect::<String>()
        )
    })?;
    let mut r = Received::new(id, m.payload.to_vec());
    r.message_type = headers.get(TYPE_HEADER).cloned();
    r.key = headers.get(KEY_HEADER).cloned();
    r.trace_parent = headers.get(TRACEPARENT_HEADER).cloned();
    r.content_type = headers.get(CONTENT_TYPE_HEADER).cloned();
    r.timestamp = headers
        .get(CREATED_AT_HEADER)
        .and_then(|t| t.parse::<i64>().ok())
        .map(Timestamp::from_millis);
    r.headers = headers;
    r.exchange = stream.to_owned();
    r.routing_key = m.subject.to_string();
    r.redelivered = redelivered;
    Ok(r)
}
