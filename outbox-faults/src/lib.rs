//! Process-level fault tests of outbox-rs.
//!
//! The library holds what the tests and the `relay-child` binary share:
//!
//! * [`ChildArgs`]: the command line of the child relay, written by the
//!   tests and parsed by the child;
//! * [`Receiver`]: the domain handler that records each delivery in a
//!   receiver database, inbox and effect in one transaction;
//! * [`CountingStore`]: a [`Store`](outbox_api::Store) wrapper that records
//!   every error the relay gets from the store, naming the call;
//! * [`RelayChild`]: a child relay process that is killed when dropped;
//! * [`check`]: enqueueing test messages, waiting on conditions, and
//!   checking what was delivered;
//! * [`postgres`]: the same on PostgreSQL, and the disruptions of the
//!   PostgreSQL fault test (`pg_terminate_backend`, a server restart);
//! * [`own_postgres`]: a PostgreSQL server of a test's own, in a temporary
//!   directory, for tests that crash or restart the server (never the
//!   shared one);
//! * [`mysql`] and [`own_mysql`]: the same on MySQL/MariaDB.
//!
//! The tests themselves are in `tests/`; see the crate's README.
#![forbid(unsafe_code)]

mod args;
pub mod check;
mod child;
mod counting;
pub mod mysql;
pub mod own_mysql;
pub mod own_postgres;
pub mod postgres;
mod receiver;
mod tally;
mod writer;

pub use args::{ChildArgs, MYSQL_URL_VARIABLE, PG_URL_VARIABLE};
pub use child::{RelayChild, assert_all_running, stop_all};
pub use counting::CountingStore;
pub use receiver::{
    MESSAGE_TYPE, RECEIVER_INBOX_TABLE, RECEIVER_OUTBOX_TABLE, Receiver, open_connection,
    prepare_receiver_schema,
};
pub use writer::Enqueued;
