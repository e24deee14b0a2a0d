//! The message model (`docs/rules.md#message-model`): what is stored in the
//! outbox table.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use uuid::Uuid;

use crate::error::{Error, Result};

/// The identity of a message: a UUID v7 (unique, time-ordered). It is also
/// the AMQP `message_id` and the inbox key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageId(Uuid);

impl MessageId {
    /// A new time-ordered id.
    pub fn new() -> Self {
        MessageId(Uuid::now_v7())
    }

    /// Wraps an existing UUID.
    pub fn from_uuid(uuid: Uuid) -> Self {
        MessageId(uuid)
    }

    /// The UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl Default for MessageId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl FromStr for MessageId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Uuid::parse_str(s)
            .map(MessageId)
            .map_err(|e| Error::invalid_input(format!("`{s}` is not a message id (UUID): {e}")))
    }
}

/// A point in time, in milliseconds since the Unix epoch (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The current wall-clock time.
    pub fn now() -> Self {
        Timestamp::from(SystemTime::now())
    }

    /// From milliseconds since the Unix epoch.
    pub const fn from_millis(millis: i64) -> Self {
        Timestamp(millis)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// This time plus `d`, saturating at the largest time (also `+`).
    pub fn saturating_add(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_millis(d)))
    }

    /// This time minus `d`, saturating at the smallest time (also `-`).
    pub fn saturating_sub(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_sub(duration_millis(d)))
    }

    /// How long after `earlier` this is; zero if it is not later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0).max(0) as u64)
    }
}

impl std::ops::Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Duration) -> Timestamp {
        self.saturating_add(d)
    }
}

impl std::ops::Sub<Duration> for Timestamp {
    type Output = Timestamp;
    fn sub(self, d: Duration) -> Timestamp {
        self.saturating_sub(d)
    }
}

fn duration_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp(duration_millis(d)),
            Err(e) => Timestamp(-duration_millis(e.duration())),
        }
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // RFC 3339 in UTC without pulling a date crate in.
        let millis = self.0.rem_euclid(1000);
        let secs = self.0.div_euclid(1000);
        let days = secs.div_euclid(86_400);
        let sod = secs.rem_euclid(86_400);
        let (y, m, d) = civil_from_days(days);
        write!(
            f,
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
            sod / 3600,
            (sod / 60) % 60,
            sod % 60
        )
    }
}

// Howard Hinnant's days-to-civil algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// Delivered in-process to the handlers registered with the [`Dispatcher`](crate::Dispatcher).
    Domain,
    /// Sent out through the [`Transport`](crate::Transport) (e.g. RabbitMQ).
    Integration,
}

impl MessageKind {
    /// `"domain"` or `"integration"`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageKind::Domain => "domain",
            MessageKind::Integration => "integration",
        }
    }
}

impl FromStr for MessageKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "domain" => Ok(MessageKind::Domain),
            "integration" => Ok(MessageKind::Integration),
            other => Err(Error::invalid_input(format!(
                "unknown message kind `{other}` (expected domain or integration)"
            ))),
        }
    }
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The life cycle of a message: `Pending` → `Processed` or `Poisoned`; a
/// human may move `Poisoned` back to `Pending`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageState {
    /// Waiting to be delivered (possibly leased by a relay right now).
    Pending,
    /// Delivered (handler returned Ok / broker confirmed), or discarded by an operator.
    Processed,
    /// Failed `max_attempts` times; waits for a human.
    Poisoned,
}

impl MessageState {
    /// `"pending"`, `"processed"` or `"poisoned"`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageState::Pending => "pending",
            MessageState::Processed => "processed",
            MessageState::Poisoned => "poisoned",
        }
    }
}

impl FromStr for MessageState {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "pending" => Ok(MessageState::Pending),
            "processed" => Ok(MessageState::Processed),
            "poisoned" => Ok(MessageState::Poisoned),
            other => Err(Error::invalid_input(format!(
                "unknown message state `{other}` (expected pending, processed or poisoned)"
            ))),
        }
    }
}

impl fmt::Display for MessageState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where an integration message is published: exchange and routing key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Destination {
    /// The exchange (`""` is RabbitMQ's default exchange).
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
}

/// A stored message, as a relay sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Unique, time-ordered id.
    pub id: MessageId,
    /// Domain (in-process) or integration (broker).
    pub kind: MessageKind,
    /// E.g. `"OrderPlaced"`: routes domain handlers; the AMQP `type`.
    pub message_type: String,
    /// Ordering key: messages with the same key are delivered in commit order.
    pub key: Option<String>,
    /// Integration only: where to publish; `None` uses the transport's defaults.
    pub destination: Option<Destination>,
    /// The body.
    pub payload: Vec<u8>,
    /// MIME type of the payload, `application/json` by default.
    pub content_type: String,
    /// String headers, carried to the broker.
    pub headers: BTreeMap<String, String>,
    /// W3C `traceparent` of the span that enqueued it.
    pub trace_parent: Option<String>,
    /// When it was enqueued.
    pub created_at: Timestamp,
    /// Not claimable before this time (delay, backoff).
    pub available_at: Timestamp,
    /// Counted failures so far.
    pub attempts: u32,
    /// The latest error, counted or not (outages too).
    pub last_error: Option<String>,
    /// Where it is in its life cycle.
    pub state: MessageState,
    /// The relay holding the lease, if any.
    pub locked_by: Option<String>,
    /// Until when that lease holds.
    pub locked_until: Option<Timestamp>,
    /// When it was processed (delivered or discarded).
    pub processed_at: Option<Timestamp>,
}

impl Message {
    /// Decodes a JSON payload.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.payload).map_err(|e| {
            Error::invalid_input(format!(
                "payload of message {} (type `{}`) does not decode as {}: {e}",
                self.id,
                self.message_type,
                std::any::type_name::<T>()
            ))
        })
    }
}

/// A payload type with a fixed message type name, used by
/// [`NewMessage::domain`], [`NewMessage::integration`] and the typed handler
/// registry ([`Handlers::on`](crate::Handlers::on)).
///
/// ```
/// # use outbox_api::OutboxMessage;
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct OrderPlaced { order_id: u64 }
/// impl OutboxMessage for OrderPlaced { const MESSAGE_TYPE: &'static str = "OrderPlaced"; }
/// ```
pub trait OutboxMessage: Serialize + serde::de::DeserializeOwned + Send + 'static {
    /// The `message_type` stored with each message of this type.
    const MESSAGE_TYPE: &'static str;
}

/// Upper bounds on what a message may contain.
pub mod limits {
    /// Longest `message_type`, in bytes.
    pub const MAX_TYPE_LEN: usize = 255;
    /// Longest ordering key, in bytes.
    pub const MAX_KEY_LEN: usize = 255;
    /// Longest header name, in bytes.
    pub const MAX_HEADER_NAME_LEN: usize = 255;
    /// Longest exchange name and routing key, in bytes (AMQP short strings).
    pub const MAX_DESTINATION_LEN: usize = 255;
}

/// A message to enqueue: built here, validated, then written inside the
/// application's transaction by a backend's `enqueue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    kind: MessageKind,
    message_type: String,
    payload: Vec<u8>,
    content_type: String,
    key: Option<String>,
    destination: Option<Destination>,
    headers: BTreeMap<String, String>,
    trace_parent: Option<String>,
    delay: Duration,
    id: Option<MessageId>,
}

impl NewMessage {
    /// A message with a raw payload.
    pub fn new(
        kind: MessageKind,
        message_type: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        NewMessage {
            kind,
            message_type: message_type.into(),
            payload: payload.into(),
            content_type: "application/octet-stream".to_owned(),
            key: None,
            destination: None,
            headers: BTreeMap::new(),
            trace_parent: None,
            delay: Duration::ZERO,
            id: None,
        }
    }

    /// A message whose payload is `value` serialised as JSON.
    pub fn json<T: Serialize + ?Sized>(
        kind: MessageKind,
        message_type: impl Into<String>,
        value: &T,
    ) -> Result<Self> {
        let message_type = message_type.into();
        let payload = serde_json::to_vec(value).map_err(|e| {
            Error::invalid_input(format!(
                "payload of `{message_type}` does not serialise to JSON: {e}"
            ))
        })?;
        Ok(NewMessage::new(kind, message_type, payload).content_type("application/json"))
    }

    /// A domain message (handled in-process) of a typed payload, as JSON.
    pub fn domain<T: OutboxMessage>(value: &T) -> Result<Self> {
        NewMessage::json(MessageKind::Domain, T::MESSAGE_TYPE, value)
    }

    /// An integration message (sent through the transport) of a typed payload, as JSON.
    pub fn integration<T: OutboxMessage>(value: &T) -> Result<Self> {
        NewMessage::json(MessageKind::Integration, T::MESSAGE_TYPE, value)
    }

    /// Sets the ordering key: same key ⇒ delivered in commit order.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Publishes to `exchange` with `routing_key` (integration messages).
    pub fn destination(
        mut self,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        self.destination = Some(Destination {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        });
        self
    }

    /// Adds a header carried to the broker.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets the payload's MIME type.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = content_type.into();
        self
    }

    /// Sets the W3C `traceparent` of the enqueuing span.
    pub fn trace_parent(mut self, trace_parent: impl Into<String>) -> Self {
        self.trace_parent = Some(trace_parent.into());
        self
    }

    /// Delivers no earlier than `delay` after the enqueue.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Uses a given id instead of a fresh UUID v7 (e.g. to forward a
    /// received message's id). Enqueuing the same id twice fails.
    pub fn with_id(mut self, id: MessageId) -> Self {
        self.id = Some(id);
        self
    }

    /// The kind.
    pub fn kind(&self) -> MessageKind {
        self.kind
    }

    /// The message type.
    pub fn message_type(&self) -> &str {
        &self.message_type
    }

    /// Checks everything a store would refuse, with an error naming the field.
    pub fn validate(&self) -> Result<()> {
        check_text("message_type", &self.message_type, limits::MAX_TYPE_LEN)?;
        if let Some(key) = &self.key {
            check_text("key", key, limits::MAX_KEY_LEN)?;
        }
        if self.content_type.is_empty() {
            return Err(Error::invalid_input("content_type must not be empty"));
        }
        for (name, value) in &self.headers {
            check_text("header name", name, limits::MAX_HEADER_NAME_LEN)?;
            if name.chars().any(|c| c.is_whitespace()) {
                return Err(Error::invalid_input(format!(
                    "header name `{}` must not contain whitespace",
                    name.escape_debug()
                )));
            }
            if value.contains('\0') {
                return Err(Error::invalid_input(format!(
                    "header `{name}` has a NUL character in its value"
                )));
            }
        }
        if let Some(tp) = &self.trace_parent {
            if !is_valid_traceparent(tp) {
                return Err(Error::invalid_input(format!(
                    "trace_parent `{}` is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)",
                    tp.escape_debug()
                )));
            }
        }
        if let Some(d) = &self.destination {
            for (field, value) in [("exchange", &d.exchange), ("routing key", &d.routing_key)] {
                if value.len() > limits::MAX_DESTINATION_LEN {
                    return Err(Error::invalid_input(format!(
                        "destination {field} is {} bytes long; at most {} are allowed",
                        value.len(),
                        limits::MAX_DESTINATION_LEN
                    )));
                }
            }
        }
        if self.kind == MessageKind::Domain && self.destination.is_some() {
            return Err(Error::invalid_input(format!(
                "`{}` is a domain message; a destination applies to integration messages only",
                self.message_type
            )));
        }
        Ok(())
    }

    /// Validates and turns this into the stored form, enqueued at `now`.
    /// Without an explicit `trace_parent`, and inside a traced span
    /// (feature `opentelemetry`; see [`trace`](crate::trace)), the message
    /// gets an `outbox.enqueue` span of its own under the current one, and
    /// stores that span's context: its delivery is the enqueue's child.
    pub fn into_message(self, now: Timestamp) -> Result<Message> {
        self.validate()?;
        let id = self.id.unwrap_or_default();
        let trace_parent = match self.trace_parent {
            Some(tp) => Some(tp),
            None => crate::trace::enqueue_traceparent(id, &self.message_type, self.key.as_deref()),
        };
        Ok(Message {
            id,
            kind: self.kind,
            message_type: self.message_type,
            key: self.key,
            destination: self.destination,
            payload: self.payload,
            content_type: self.content_type,
            headers: self.headers,
            trace_parent,
            created_at: now,
            available_at: now.saturating_add(self.delay),
            attempts: 0,
            last_error: None,
            state: MessageState::Pending,
            locked_by: None,
            locked_until: None,
            processed_at: None,
        })
    }
}

fn check_text(field: &str, value: &str, max: usize) -> Result<()> {
    if value.trim().is_empty() {
        return Err(Error::invalid_input(format!("{field} must not be empty")));
    }
    if value.len() > max {
        return Err(Error::invalid_input(format!(
            "{field} is {} bytes long; at most {max} are allowed",
            value.len()
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(Error::invalid_input(format!(
            "{field} `{}` contains a control character",
            value.escape_debug()
        )));
    }
    Ok(())
}

/// Whether `s` is a W3C trace-context `traceparent` (version 00 layout).
pub fn is_valid_traceparent(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str, n: usize| {
        p.len() == n
            && p.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_formats_rfc3339() {
        assert_eq!(
            Timestamp::from_millis(0).to_string(),
            "1970-01-01T00:00:00.000Z"
        );
        assert_eq!(
            Timestamp::from_millis(1_764_441_600_123).to_string(),
            "2025-11-29T18:40:00.123Z"
        );
    }

    #[test]
    fn validation_names_the_field() {
        let m = NewMessage::new(MessageKind::Domain, "", b"x".to_vec());
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("message_type")
        );
        let m = NewMessage::new(MessageKind::Domain, "T", b"x".to_vec()).header("a b", "v");
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("header name")
        );
        let m = NewMessage::new(MessageKind::Domain, "T", b"x".to_vec()).trace_parent("nope");
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("trace_parent")
        );
        let m = NewMessage::new(MessageKind::Domain, "T", b"x".to_vec()).destination("e", "k");
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("destination")
        );
        let m = NewMessage::new(MessageKind::Integration, "T", vec![0xff, 0])
            .key("k")
            .trace_parent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        m.validate().unwrap();
    }

    #[test]
    fn serialisation_failure_is_a_clear_error() {
        let mut map = std::collections::HashMap::new();
        map.insert((1, 2), 3);
        let err = NewMessage::json(MessageKind::Domain, "Bad", &map).unwrap_err();
        assert!(
            err.to_string().contains("`Bad` does not serialise"),
            "{err}"
        );
    }
}
