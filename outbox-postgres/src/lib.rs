#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod announce;
mod builder;
mod claim_sql;
mod error;
mod existing;
mod floor;
mod inbox;
mod listener;
mod migrate;
mod operator;
mod outbox;
mod own_lock;
mod queue;
mod row;
mod schema;
mod shared_listener;
mod store;
mod tenant_pools;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "tokio-postgres")]
mod tokio_pg;

pub use builder::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_NOTIFY_DEBOUNCE, DEFAULT_POLL,
    PgStoreBuilder,
};
pub use error::error_kind;
pub use existing::outbox_tables;
pub use floor::DEFAULT_FLOOR_STEP;
pub use inbox::PgInbox;
pub use listener::{PgWorkListener, WakeUp};
pub use outbox::{PgEnqueue, PgOutbox};
pub use schema::{DEFAULT_INBOX_TABLE, DEFAULT_OUTBOX_TABLE, DEFAULT_SCHEMA};
pub use shared_listener::PgSharedListener;
pub use store::{BULK_ROWS, PgStore};
pub use tenant_pools::{PgTenantPools, TENANT_STATEMENT_CACHE};

/// The sqlx version this crate links against, re-exported so that
/// applications use the same one.
pub use sqlx;

#[cfg(feature = "tokio-postgres")]
pub use tokio_pg::PreparedEnqueue;
/// The tokio-postgres version this crate links against (feature
/// `tokio-postgres`), re-exported so that applications use the same one.
#[cfg(feature = "tokio-postgres")]
pub use tokio_postgres;
