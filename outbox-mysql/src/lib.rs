#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod builder;
mod claim;
mod error;
mod existing;
mod inbox;
mod listener;
mod migrate;
mod operator;
mod outbox;
mod row;
mod schema;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use builder::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_POLL_FAST, DEFAULT_POLL_IDLE,
    MySqlStoreBuilder, ServerVersion,
};
pub use error::error_kind;
pub use existing::outbox_tables;
pub use inbox::MySqlInbox;
pub use listener::{HINT_WINDOW, MySqlWorkListener};
pub use outbox::{BATCH_ROWS, MySqlEnqueue, MySqlOutbox};
pub use schema::{DEFAULT_INBOX_TABLE, DEFAULT_OUTBOX_TABLE, KEY_SLOTS};
pub use store::MySqlStore;

/// The sqlx version this crate links against, re-exported so that
/// applications use the same one.
pub use sqlx;
