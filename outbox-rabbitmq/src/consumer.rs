//! [`RabbitConsumer`]: consumes a queue into any store's
//! [`Inbox`](outbox_api::Inbox) (memory, SQLite, PostgreSQL), so that
//! at-least-once delivery gives exactly-once effects.
//!
//! One concern per module: [`builder`] (settings, checks, spawn),
//! [`received`] (decoding a delivery), [`session`] (connect,
//! consume, reconnect), [`settle`] (run the inbox transaction, then
//! acknowledge, retry or dead-letter), [`handle`] (the running consumer's
//! handle). What every broker's consumer shares — the decoded message, the
//! handler, the held lanes, the retry rules, the counters, the inbox purge
//! — is [`outbox_api::receive`].
//!
//! # Per-key order on retry: retry in place, hold the key behind it
//!
//! The relay delivers the messages of one ordering key in order (header
//! `x-outbox-key`), and the consumer keeps that order through retries. A
//! delivery that is not settled after a try (handler failed, handler
//! temporarily unavailable, database failing) is **kept** in this process,
//! unacknowledged, and tried again in place when its delay is over (a timer
//! per held delivery, [`Held`](outbox_api::receive::Held)). Until it is acknowledged or
//! dead-lettered, later deliveries of its key are parked behind it in
//! memory, in arrival order; when it is settled they run in order, and the
//! first of them that needs a retry becomes the new head. Deliveries of
//! other keys (and without a key) go on meanwhile: the consume loop waits on
//! the next delivery and the next due retry alike.
//!
//! Why not `basic.nack` with requeue after the delay, as before: a requeued
//! delivery goes back to the *head* of the queue, but up to `prefetch`
//! later deliveries of the same key are already buffered in this process,
//! so they would be handled before it — the receiver would reorder a key
//! that the relay delivered in order. Why not a dead-letter/TTL retry
//! queue: it sends the retry behind *everything* queued meanwhile, which
//! reorders too. Retry in place needs no broker topology and keeps order;
//! its costs are that held deliveries keep their prefetch slots (if
//! `prefetch` of them wait behind one key, nothing else arrives until that
//! key moves) and that the attempt count lives in this process (a restart
//! counts again, as before). When the connection is lost, everything held
//! belongs to the closed channel: the broker requeues it in queue order and
//! it comes back redelivered; the inbox makes a redelivery of a committed
//! message a no-op.

mod builder;
mod handle;
mod received;
mod session;
mod settle;

pub use builder::{RabbitConsumer, RabbitConsumerBuilder};
pub use handle::ConsumerHandle;
pub use outbox_api::receive::{
    ConsumerStats, FnHandler, HandlerFuture, InboxHandler, Received, handler_fn,
};
