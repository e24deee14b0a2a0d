//! [`RabbitConsumer`]: consumes a queue into a SQLite inbox (feature
//! `sqlite-inbox`), so that at-least-once delivery gives exactly-once
//! effects.
//!
//! One concern per module: [`builder`] (settings, checks, spawn),
//! [`received`] (the decoded delivery), [`handler`] (the application's
//! handler), [`session`] (connect, consume, reconnect), [`settle`] (run the
//! inbox transaction, then ack, requeue or dead-letter), [`handle`] (the
//! running consumer's handle and stats, the inbox purge).

mod builder;
mod handle;
mod handler;
mod received;
mod session;
mod settle;

pub use builder::{RabbitConsumer, RabbitConsumerBuilder};
pub use handle::{ConsumerHandle, ConsumerStats};
pub use handler::{FnHandler, HandlerFuture, InboxHandler, handler_fn};
pub use received::Received;
