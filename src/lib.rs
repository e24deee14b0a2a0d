#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod relay;

pub use config::RelayConfig;
pub use relay::{DrainReport, Relay, RelayBuilder, RelayHandle};

pub use outbox_api::*;

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

/// The RabbitMQ transport (feature `rabbitmq`).
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq {
    pub use outbox_rabbitmq::*;
}
