#![doc = include_str!("../README.md")]
// One call into SQLite's C API has no safe wrapper in sqlx: the busy
// handler of an application's connection (`lock_wait::install_on`).
#![deny(unsafe_code)]
#![warn(missing_docs)]
// Without a driver feature the enqueue plumbing (statements, encoding) has
// no caller: a store for relays and operators only.
#![cfg_attr(
    not(all(feature = "sqlx", feature = "rusqlite")),
    allow(dead_code, unused_imports)
)]

mod builder;
mod checkpoint;
mod error;
mod existing;
mod files;
#[cfg(feature = "sqlx")]
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
pub use files::SqliteFiles;
#[cfg(feature = "sqlx")]
pub use inbox::SqliteInbox;
pub use listener::SqliteListener;
#[cfg(feature = "sqlx")]
pub use outbox::SqliteEnqueue;
pub use outbox::SqliteOutbox;
/// How one [`SqliteOutbox::receive_once`] ended (defined in `outbox-api`,
/// shared with the other backends).
pub use outbox_api::InboxOutcome;
pub use schema::{DEFAULT_INBOX_TABLE, DEFAULT_OUTBOX_TABLE};
pub use store::SqliteStore;

/// The sqlx and rusqlite versions this crate links against, re-exported so
/// that applications use the same ones.
#[cfg(feature = "rusqlite")]
pub use rusqlite;
#[cfg(feature = "sqlx")]
pub use sqlx;
