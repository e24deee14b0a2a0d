#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod builder;
mod checkpoint;
mod error;
mod existing;
mod inbox;
mod listener;
mod lock_wait;
mod operator;
mod outbox;
mod row;
mod schema;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use builder::{DEFAULT_BUSY_TIMEOUT, DEFAULT_CHANGE_POLL, SqliteStoreBuilder};
pub use checkpoint::DEFAULT_CHECKPOINT_PAGES;
pub use inbox::SqliteInbox;
pub use listener::SqliteListener;
pub use outbox::{SqliteEnqueue, SqliteOutbox};
/// How one [`SqliteOutbox::receive_once`] ended (defined in `outbox-api`,
/// shared with the other backends).
pub use outbox_api::InboxOutcome;
pub use schema::{DEFAULT_INBOX_TABLE, DEFAULT_OUTBOX_TABLE};
pub use store::SqliteStore;

/// The sqlx and rusqlite versions this crate links against, re-exported so
/// that applications use the same ones.
pub use {rusqlite, sqlx};
