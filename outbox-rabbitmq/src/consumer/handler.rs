//! [`InboxHandler`]: the application's code run on each received message,
//! and [`handler_fn`] for closures.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::HandlerError;

use super::Received;

/// Handles received messages inside the inbox transaction.
///
/// `Conn` is the connection type of the store's [`Inbox`](outbox_api::Inbox)
/// the consumer records in: `SqliteConnection` for `SqliteInbox`,
/// `PgConnection` for `PgInbox`, `MemoryTransaction` for `MemoryInbox`.
///
/// # Contract
///
/// `conn` is the open transaction in which the consumer has just recorded
/// the message in the inbox (`BEGIN IMMEDIATE` on SQLite, `BEGIN` on
/// PostgreSQL): do the message's effects with it, and enqueue any replies
/// with the store's outbox (`SqliteOutbox::enqueue(&mut *conn, …)`,
/// `PgOutbox::enqueue(conn, …)`) — everything commits together with the
/// inbox row, and the delivery is acknowledged only after that commit. A
/// message found in the inbox already never reaches the handler.
///
/// * `Err` (or a panic, or running past the handler timeout) rolls the
///   transaction back; the delivery is tried again a bounded number of
///   times, then dead-lettered.
/// * An error that is (or wraps)
///   [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable) — a
///   downstream of the handler is down — rolls back too, but the delivery is
///   tried again after a growing backoff without counting an attempt, for as
///   long as it takes. So does an error whose source chain holds a database
///   error meaning "unavailable or busy, try later" (connection lost, pool
///   timed out, SQLite busy, deadlock), on every store alike (see
///   [`outbox_api::classify_handler_error`]).
///
/// Deliveries of one ordering key reach the handler in order, one at a
/// time, retries included (see [`RabbitConsumer`](crate::RabbitConsumer)).
///
/// Do not commit or roll back `conn` yourself. On PostgreSQL, return every
/// SQL error you meet: a statement that failed aborts the transaction, and
/// a handler that swallows it and returns `Ok` is treated as failed.
///
/// Closures work through [`handler_fn`].
#[async_trait]
pub trait InboxHandler<Conn: ?Sized + Send>: Send + Sync + 'static {
    /// Handles one message within the inbox transaction `conn`.
    async fn handle(&self, msg: &Received, conn: &mut Conn) -> Result<(), HandlerError>;
}

#[async_trait]
impl<Tx: ?Sized + Send, H: InboxHandler<Tx> + ?Sized> InboxHandler<Tx> for Arc<H> {
    async fn handle(&self, msg: &Received, tx: &mut Tx) -> Result<(), HandlerError> {
        (**self).handle(msg, tx).await
    }
}

/// The future a closure given to [`handler_fn`] returns.
pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// An [`InboxHandler`] made of a closure; see [`handler_fn`].
pub struct FnHandler<F>(F);

impl<F> fmt::Debug for FnHandler<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnHandler")
    }
}

/// Turns a closure returning a boxed future into an [`InboxHandler`] on the
/// connection type the closure takes (`SqliteConnection`, `PgConnection`,
/// `MemoryTransaction`):
///
/// ```
/// use outbox_api::{MessageKind, NewMessage};
/// use outbox_memory::MemoryTransaction;
/// use outbox_rabbitmq::{HandlerFuture, Received, handler_fn};
///
/// let handler = handler_fn(|msg: &Received, tx: &mut MemoryTransaction| -> HandlerFuture<'_> {
///     Box::pin(async move {
///         let reply = NewMessage::new(MessageKind::Integration, "Seen", msg.payload.clone());
///         tx.enqueue(reply)?;
///         Ok(())
///     })
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<Tx, F>(f: F) -> FnHandler<F>
where
    Tx: ?Sized + Send,
    F: for<'a> Fn(&'a Received, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    FnHandler(f)
}

#[async_trait]
impl<Tx, F> InboxHandler<Tx> for FnHandler<F>
where
    Tx: ?Sized + Send,
    F: for<'a> Fn(&'a Received, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    async fn handle(&self, msg: &Received, tx: &mut Tx) -> Result<(), HandlerError> {
        (self.0)(msg, tx).await
    }
}
