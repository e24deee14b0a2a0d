//! The receiving side every broker's consumer shares: the decoded message
//! ([`Received`]), the application's handler ([`InboxHandler`]), what to do
//! after one try ([`RetryRules::settle`]), and the deliveries held back per
//! ordering key while the first of them waits for its retry ([`Held`]).
//!
//! A consumer (RabbitMQ's, NATS's) decodes a delivery into a [`Received`],
//! runs it through an [`Inbox`](crate::Inbox) with the handler, and settles
//! it by [`Settle`]: acknowledge, dead-letter, or keep it in this process
//! and try it again in place after a delay, later deliveries of its key
//! queued behind it so that the key's order holds through retries.
//! Deliveries of other keys go on meanwhile.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{Error, HandlerError, MessageId, Result, Timestamp};

/// A message received from a broker, decoded from its delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Received {
    /// The sender's outbox id (AMQP `message_id`, NATS `Nats-Msg-Id`): the
    /// inbox key.
    pub id: MessageId,
    /// The outbox `message_type` (AMQP `type`, NATS `Outbox-Type`), if set.
    pub message_type: Option<String>,
    /// The ordering key, if any.
    pub key: Option<String>,
    /// The W3C `traceparent` of the span that enqueued the message, if any.
    pub trace_parent: Option<String>,
    /// Every header carried as text (AMQP scalars as text), the ones above
    /// included.
    pub headers: BTreeMap<String, String>,
    /// The payload's MIME type, if set.
    pub content_type: Option<String>,
    /// The body, unchanged.
    pub payload: Vec<u8>,
    /// When it was sent or enqueued, if the broker says (AMQP `timestamp`,
    /// seconds; NATS `Outbox-Created-At`, milliseconds).
    pub timestamp: Option<Timestamp>,
    /// Where it was published: the AMQP exchange (`""`: the default
    /// exchange); on NATS, the JetStream stream it was stored in.
    pub exchange: String,
    /// How it was routed: the AMQP routing key; on NATS, the subject.
    pub routing_key: String,
    /// Whether the broker delivered it before (to this or another consumer).
    /// A retry in place is not a redelivery: it keeps the broker's flag.
    pub redelivered: bool,
    /// Which try of this consumer process this is (1 the first time; counts
    /// handler failures, not outages).
    pub attempt: u32,
}

impl Received {
    /// A received message with `id` and `payload`, everything else empty
    /// (for consumers' decoders and tests).
    pub fn new(id: MessageId, payload: Vec<u8>) -> Self {
        Received {
            id,
            message_type: None,
            key: None,
            trace_parent: None,
            headers: BTreeMap::new(),
            content_type: None,
            payload,
            timestamp: None,
            exchange: String::new(),
            routing_key: String::new(),
            redelivered: false,
            attempt: 1,
        }
    }

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
}

/// Handles received messages inside the inbox transaction.
///
/// `Conn` is the connection type of the store's [`Inbox`](crate::Inbox)
/// the consumer records in: `SqliteConnection` for `SqliteInbox`,
/// `PgConnection` for `PgInbox`, `MemoryTransaction` for `MemoryInbox`.
///
/// # Contract
///
/// `conn` is the open transaction in which the consumer has just recorded
/// the message in the inbox (`BEGIN IMMEDIATE` on SQLite, `BEGIN` on
/// PostgreSQL): do the message's effects with it, and enqueue any replies
/// with the store's outbox (`SqliteOutbox::enqueue(&mut *conn, …)`,
/// `PgOutbox::enqueue(conn, …)`) — everything commits together with the
/// inbox row, and the delivery is acknowledged only after that commit. A
/// message found in the inbox already never reaches the handler.
///
/// * `Err` (or a panic, or running past the handler timeout) rolls the
///   transaction back; the delivery is tried again a bounded number of
///   times, then dead-lettered.
/// * An error that is (or wraps)
///   [`TemporarilyUnavailable`](crate::TemporarilyUnavailable) — a
///   downstream of the handler is down — rolls back too, but the delivery is
///   tried again after a growing backoff without counting an attempt, for as
///   long as it takes. So does an error whose source chain holds a database
///   error meaning "unavailable or busy, try later" (connection lost, pool
///   timed out, SQLite busy, deadlock), on every store alike (see
///   [`classify_handler_error`](crate::classify_handler_error)).
///
/// Deliveries of one ordering key reach the handler in order, one at a
/// time, retries included.
///
/// Do not commit or roll back `conn` yourself. On PostgreSQL, return every
/// SQL error you meet: a statement that failed aborts the transaction, and
/// a handler that swallows it and returns `Ok` is treated as failed.
///
/// Closures work through [`handler_fn`].
#[async_trait]
pub trait InboxHandler<Conn: ?Sized + Send>: Send + Sync + 'static {
    /// Handles one message within the inbox transaction `conn`.
    async fn handle(&self, msg: &Received, conn: &mut Conn) -> Result<(), HandlerError>;
}

#[async_trait]
impl<Tx: ?Sized + Send, H: InboxHandler<Tx> + ?Sized> InboxHandler<Tx> for Arc<H> {
    async fn handle(&self, msg: &Received, tx: &mut Tx) -> Result<(), HandlerError> {
        (**self).handle(msg, tx).await
    }
}

/// The future a closure given to [`handler_fn`] returns.
pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// An [`InboxHandler`] made of a closure; see [`handler_fn`].
pub struct FnHandler<F>(F);

impl<F> fmt::Debug for FnHandler<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnHandler")
    }
}

/// Turns a closure returning a boxed future into an [`InboxHandler`] on the
/// connection type the closure takes (`SqliteConnection`, `PgConnection`,
/// `MemoryTransaction`):
///
/// ```
/// use outbox_api::receive::{HandlerFuture, InboxHandler, Received, handler_fn};
///
/// struct Conn; // the store's connection type, e.g. `MemoryTransaction`
/// let handler = handler_fn(|msg: &Received, conn: &mut Conn| -> HandlerFuture<'_> {
///     Box::pin(async move {
///         let _ = (msg.id, conn);
///         Ok(())
///     })
/// });
/// fn takes(_: impl InboxHandler<Conn>) {}
/// takes(handler);
/// ```
pub fn handler_fn<Tx, F>(f: F) -> FnHandler<F>
where
    Tx: ?Sized + Send,
    F: for<'a> Fn(&'a Received, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    FnHandler(f)
}

#[async_trait]
impl<Tx, F> InboxHandler<Tx> for FnHandler<F>
where
    Tx: ?Sized + Send,
    F: for<'a> Fn(&'a Received, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    async fn handle(&self, msg: &Received, tx: &mut Tx) -> Result<(), HandlerError> {
        (self.0)(msg, tx).await
    }
}

/// Exponential backoff: `min` after the first failure, doubling per
/// failure up to `max`, ±20 % jitter (so that many waiting clients do not
/// all come back at once).
pub fn backoff(min: Duration, max: Duration, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(20);
    let base = min.saturating_mul(1 << exp).min(max);
    base.mul_f64(0.8 + 0.4 * fastrand::f64())
}

mod bound;
mod lanes;
mod purge;
mod settle;
mod stats;

pub use bound::{BoundInbox, Receiver, bind};
pub use lanes::{Held, Lane, Pending};
pub use purge::{INBOX_PURGE_BATCH, purge_inbox_loop};
pub use settle::{Attempts, RetryRules, Settle};
pub use stats::{ConsumerStats, Counters, bump};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps() {
        let min = Duration::from_millis(100);
        let max = Duration::from_secs(30);
        let first = backoff(min, max, 1);
        assert!(first >= Duration::from_millis(80) && first <= Duration::from_millis(120));
        let later = backoff(min, max, 4);
        assert!(later >= Duration::from_millis(640) && later <= Duration::from_millis(960));
        assert!(backoff(min, max, 1000) <= Duration::from_secs(36));
    }
}
