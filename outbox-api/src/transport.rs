//! Sending integration messages out.

use std::fmt::Debug;

use async_trait::async_trait;

use crate::message::Message;

/// What became of one message handed to a [`Transport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The broker confirmed it (and did not return it).
    Delivered,
    /// The message's own fault (nack, unroutable, too large, cannot be
    /// encoded): counts as an attempt.
    Rejected(String),
    /// The broker's fault (connection lost, no confirm in time): does **not**
    /// count as an attempt; the relay pauses the transport and probes it.
    Unavailable(String),
}

/// Sends integration messages, a batch at a time.
///
/// # Contract
/// * [`send`](Transport::send) returns exactly one [`Outcome`] per message,
///   in the order given. A missing outcome is treated as `Unavailable`.
/// * `Delivered` only once the broker confirmed the message and did not
///   return it as unroutable. Anything uncertain is `Unavailable`: the relay
///   will send it again (at-least-once), never lose it.
/// * Messages of one batch are sent in the order given (the relay puts at
///   most one message per ordering key in a batch).
/// * `send` may be called concurrently, from several tasks, to keep more
///   messages unconfirmed at once; an implementation must not mix up the
///   outcomes of concurrent calls. Concurrent calls never hold two messages
///   of one ordering key: the relay hands a key's next message to `send`
///   only after the call holding the previous one returned. Order between
///   concurrent calls is not defined.
/// * A refusal caused by one message (it cannot be routed, its destination
///   refuses it, it is too large) is that message's `Rejected`, never
///   `Unavailable` for the others.
/// * After an `Unavailable`, the transport recovers by itself (reconnect with
///   backoff); [`probe`](Transport::probe) tells the relay when it is back.
/// * A send should end within the transport's own timeouts. The relay drops
///   one that outlives its `handler_timeout` and counts its messages as
///   unavailable (they are sent again); a dropped send must leave the
///   transport usable.
#[async_trait]
pub trait Transport: Send + Sync + Debug + 'static {
    /// Sends a batch; one outcome per message, same order.
    async fn send(&self, batch: &[Message]) -> Vec<Outcome>;

    /// Checks whether the broker can be used again (e.g. reconnects); `Err`
    /// says why not (usually `ErrorKind::Unavailable`; a refused login is
    /// `ErrorKind::Config`).
    async fn probe(&self) -> crate::Result<()>;
}
