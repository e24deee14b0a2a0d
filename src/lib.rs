#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod fleet;
pub mod metrics;
mod relay;

pub use config::RelayConfig;
pub use fleet::{
    Catalogue, DEFAULT_FLEET_CONCURRENCY, DEFAULT_SWEEP, Discovery, DiscoveryReport, Fleet,
    FleetBuilder, FleetHealth,
};
pub use relay::{DrainReport, Relay, RelayBuilder, RelayHandle};

// The contracts, named one by one so that the facade's surface is a
// decision, not whatever `outbox-api` happens to export.
/// Helpers for authors of stores and transports.
pub use outbox_api::backend;
/// What every broker's consumer shares: the received message, the inbox
/// handler, the retry rules.
pub use outbox_api::receive;
/// The conformance suite every store and transport runs (feature `testing`
/// of `outbox-api`).
#[cfg(feature = "testing")]
pub use outbox_api::testing;
/// W3C trace context helpers.
pub use outbox_api::trace;
pub use outbox_api::{
    Backlog, ClaimRequest, Clock, Destination, Dispatcher, Enqueue, Error, ErrorKind, FailOutcome,
    Failure, Handler, HandlerError, HandlerOutcome, Handlers, HealthReport, HealthStatus, Inbox,
    InboxOutcome, InboxWork, ListQuery, ManualClock, Message, MessageContext, MessageId,
    MessageKind, MessageState, NewMessage, NoHandler, OperatorStore, OutboxMessage, Outcome,
    Release, Result, RetryPolicy, Stats, Store, SystemClock, TemporarilyUnavailable, Timestamp,
    TokioClock, Transport, TransportHealth, WorkListener, error_chain, is_valid_traceparent,
    limits, panic_message, run_guarded,
};

/// The in-memory backend (feature `memory`).
#[cfg(feature = "memory")]
pub mod memory {
    pub use outbox_memory::*;
}

/// The SQLite backend (feature `sqlite`).
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use outbox_sqlite::*;
}

/// The PostgreSQL backend (feature `postgres`).
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use outbox_postgres::*;
}

/// The MySQL/MariaDB backend (feature `mysql`).
#[cfg(feature = "mysql")]
pub mod mysql {
    pub use outbox_mysql::*;
}

/// The RabbitMQ transport (feature `rabbitmq`).
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq {
    pub use outbox_rabbitmq::*;
}

/// The NATS JetStream transport (feature `nats`).
#[cfg(feature = "nats")]
pub mod nats {
    pub use outbox_nats::*;
}

/// The Kafka transport (feature `kafka`).
#[cfg(feature = "kafka")]
pub mod kafka {
    pub use outbox_kafka::*;
}
