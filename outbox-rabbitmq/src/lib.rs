#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod consumer;
pub mod metrics;
mod partition;
#[cfg(feature = "testing")]
pub mod testing;
mod topology;
mod transport;

pub use config::{MAX_SHORT_STRING, RabbitConfig, URL_ENV};
pub use partition::{MAX_PARTITIONS, Partitions};
pub use topology::{ExchangeType, QueueType, Topology};
pub use transport::{KEY_HEADER, RabbitTransport, TRACEPARENT_HEADER};

pub use consumer::{
    ConsumerHandle, ConsumerStats, FnHandler, HandlerFuture, InboxHandler, RabbitConsumer,
    RabbitConsumerBuilder, Received, handler_fn,
};
/// The handler error type of [`InboxHandler`] (any boxed error).
pub use outbox_api::HandlerError;

/// The AMQP client this crate is built on, for code that needs its types
/// (e.g. [`Topology::declare_on`] takes a `lapin::Channel`).
pub use lapin;
