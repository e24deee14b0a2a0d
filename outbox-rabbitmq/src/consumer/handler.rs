//! [`InboxHandler`]: the application's code run on each received message,
//! and [`handler_fn`] for closures.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::HandlerError;
use outbox_sqlite::sqlx::SqliteConnection;

#[cfg(doc)]
use outbox_sqlite::SqliteOutbox;

use super::Received;

/// Handles received messages inside the inbox transaction.
///
/// `tx` is the open SQLite transaction (`BEGIN IMMEDIATE`) in which the
/// consumer has just recorded the message in the inbox: do the message's
/// effects with it, and enqueue any replies with
/// [`SqliteOutbox::enqueue`]`(&mut *tx, …)` — everything commits together
/// with the inbox row, and the delivery is acknowledged only after that
/// commit. Returning `Err` (or panicking, or exceeding the handler timeout)
/// rolls the transaction back; the delivery is tried again a bounded number
/// of times, then dead-lettered. Returning an error that is (or wraps)
/// [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable) — a
/// downstream of the handler is down — rolls back too, but the delivery is
/// tried again after a growing backoff without counting an attempt, for as
/// long as it takes.
///
/// Deliveries of one ordering key reach the handler in order, one at a
/// time, retries included (see [`RabbitConsumer`](crate::RabbitConsumer)).
///
/// Do not commit or roll back `tx` yourself.
///
/// Closures work through [`handler_fn`].
#[async_trait]
pub trait InboxHandler: Send + Sync + 'static {
    /// Handles one message within the inbox transaction `tx`.
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError>;
}

#[async_trait]
impl<H: InboxHandler + ?Sized> InboxHandler for Arc<H> {
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
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

/// Turns a closure returning a boxed future into an [`InboxHandler`]:
///
/// ```no_run
/// use outbox_rabbitmq::{HandlerFuture, Received, handler_fn};
/// use outbox_rabbitmq::sqlite::sqlx::SqliteConnection;
///
/// let handler = handler_fn(|msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
///     Box::pin(async move {
///         outbox_rabbitmq::sqlite::sqlx::query("INSERT INTO seen (id) VALUES (?)")
///             .bind(msg.id.to_string())
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     })
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<F>(f: F) -> FnHandler<F>
where
    F: for<'a> Fn(&'a Received, &'a mut SqliteConnection) -> HandlerFuture<'a>
        + Send
        + Sync
        + 'static,
{
    FnHandler(f)
}

#[async_trait]
impl<F> InboxHandler for FnHandler<F>
where
    F: for<'a> Fn(&'a Received, &'a mut SqliteConnection) -> HandlerFuture<'a>
        + Send
        + Sync
        + 'static,
{
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        (self.0)(msg, tx).await
    }
}
