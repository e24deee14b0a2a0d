#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod consumer;
mod stream;
pub mod subject;
#[cfg(feature = "testing")]
pub mod testing;
mod transport;

pub use config::{NatsConfig, SubjectFn, URL_ENV};
pub use consumer::{
    DEAD_ATTEMPTS_HEADER, DEAD_CONSUMER_HEADER, DEAD_REASON_HEADER, DEAD_SUBJECT_HEADER,
    NatsConsumer, NatsConsumerBuilder, NatsConsumerHandle,
};
/// The receiving side's types, shared with every consumer of outbox-rs.
pub use outbox_api::receive::{
    ConsumerStats, FnHandler, HandlerFuture, InboxHandler, Received, handler_fn,
};
pub use stream::{DEFAULT_DUPLICATE_WINDOW, StreamSpec};
pub use transport::{
    CONTENT_TYPE_HEADER, CREATED_AT_HEADER, KEY_HEADER, MSG_ID_HEADER, NatsTransport,
    TRACEPARENT_HEADER, TYPE_HEADER,
};

/// The NATS client this crate is built on, for code that needs its types.
pub use async_nats;
