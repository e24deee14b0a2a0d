#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod config;
mod consumer;
#[cfg(feature = "testing")]
pub mod testing;
mod transport;

pub use config::KafkaConfig;
pub use consumer::{
    DEAD_ATTEMPTS_HEADER, DEAD_GROUP_HEADER, DEAD_OFFSET_HEADER, DEAD_REASON_HEADER,
    DEAD_TOPIC_HEADER, KafkaConsumer, KafkaConsumerBuilder, KafkaConsumerHandle,
};
pub use transport::{
    CONTENT_TYPE_HEADER, CREATED_AT_HEADER, ID_HEADER, KEY_HEADER, KafkaTransport,
    TRACEPARENT_HEADER, TYPE_HEADER,
};

/// The variable the tests read the broker's address from.
pub const URL_ENV: &str = "OUTBOX_KAFKA_URL";

/// The rdkafka crate, for code that needs more of the client.
pub use rdkafka;
