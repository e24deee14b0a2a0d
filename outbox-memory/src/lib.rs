//! In-memory backend of outbox-rs: a [`MemoryStore`] with transactions, its
//! [`MemoryInbox`], and a [`MemoryTransport`] with fault injection.
//!
//! It is the reference implementation of the contracts in `outbox-api` and
//! the backend for unit tests: application code that enqueues can be tested
//! against it with no database.
//!
//! ```
//! use outbox_api::{MessageKind, NewMessage, Store};
//! use outbox_memory::MemoryStore;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = MemoryStore::new();
//! let mut tx = store.begin();
//! tx.enqueue(NewMessage::new(MessageKind::Domain, "Ping", b"{}".to_vec()))?;
//! tx.commit()?;
//! assert_eq!(store.stats().await?.pending, 1);
//! # Ok::<_, outbox_api::Error>(()) }).unwrap();
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod inbox;
mod store;
#[cfg(feature = "testing")]
mod testing;
mod transport;

pub use inbox::MemoryInbox;
pub use store::{MemoryStore, MemoryTransaction};
pub use transport::{MemoryTransport, MemoryTransportHandle};
