//! Contracts of [outbox-rs](https://github.com/outbox-rs/outbox-rs): the
//! message model, the [`Store`], [`Transport`] and [`Dispatcher`] traits,
//! the error type, retry policy and health types.
//!
//! Backends depend on this crate only; applications use the `outbox` facade.
//! With the `testing` feature, the `testing` module holds the conformance suite that
//! every backend runs.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod activity;
pub mod backend;
mod dispatch;
mod enqueue;
mod error;
mod guard;
mod health;
mod inbox;
mod message;
mod names;
pub mod partition;
mod purge;
pub mod receive;
mod retry;
mod row;
mod store;
pub mod trace;
mod transport;

#[cfg(feature = "testing")]
pub mod testing;

pub use dispatch::{
    Dispatcher, Handler, HandlerError, Handlers, MessageContext, NoHandler, error_chain,
    panic_message,
};
pub use enqueue::Enqueue;
pub use error::{Error, ErrorKind, Result};
pub use guard::{HandlerOutcome, TemporarilyUnavailable, run_guarded};
pub use health::{HealthReport, HealthStatus, TransportHealth, backlog_reasons, format_age};
pub use inbox::{Inbox, InboxOutcome, InboxWork, classify_handler_error, run_inbox_handler};
pub use message::{
    Destination, Message, MessageId, MessageKind, MessageState, NewMessage, OutboxMessage,
    Timestamp, is_valid_traceparent, limits,
};
pub use retry::RetryPolicy;
pub use store::{
    Backlog, ClaimRequest, Clock, FailOutcome, Failure, ListQuery, ManualClock, OperatorAction,
    OperatorStore, Release, Stats, Store, SystemClock, TokioClock, WorkListener,
};
pub use transport::{Outcome, Transport};
