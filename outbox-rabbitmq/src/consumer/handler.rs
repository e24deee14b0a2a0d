//! [`InboxHandler`]: the application's code run on each received message,
//! and [`handler_fn`] for closures.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::HandlerError;
#[cfg(feature = "sqlite-inbox")]
use outbox_sqlite::sqlx::SqliteConnection;

use super::Received;

/// Declares [`InboxHandler`], with `SqliteConnection` as the default
/// connection type when the SQLite inbox is built (so that enabling
/// another inbox never changes what `InboxHandler` alone means).
macro_rules! inbox_handler_trait {
    ($($default:tt)*) => {
        /// Handles received messages inside the inbox transaction.
        ///
        /// `Tx` is the connection of the inbox's database: `SqliteConnection`
        /// for the SQLite inbox (feature `sqlite-inbox`, the default type
        /// there), `PgConnection` for the PostgreSQL inbox (feature
        /// `postgres-inbox`, `InboxHandler<PgConnection>`).
        ///
        /// # Contract
        ///
        /// `tx` is the open transaction in which the consumer has just
        /// recorded the message in the inbox (`BEGIN IMMEDIATE` on SQLite,
        /// `BEGIN` on PostgreSQL): do the message's effects with it, and
        /// enqueue any replies with the backend's outbox
        /// (`SqliteOutbox::enqueue(&mut *tx, …)`, `PgOutbox::enqueue(tx, …)`)
        /// — everything commits together with the inbox row, and the
        /// delivery is acknowledged only after that commit. A message found
        /// in the inbox already never reaches the handler.
        ///
        /// * `Err` (or a panic, or running past the handler timeout) rolls
        ///   the transaction back; the delivery is tried again a bounded
        ///   number of times, then dead-lettered.
        /// * An error that is (or wraps)
        ///   [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable)
        ///   — a downstream of the handler is down — rolls back too, but the
        ///   delivery is tried again after a growing backoff without
        ///   counting an attempt, for as long as it takes. On PostgreSQL an
        ///   error whose source chain holds a database error meaning "try
        ///   later" (connection lost, deadlock, serialization failure) counts
        ///   as that too (see `PgOutbox::receive_once`).
        ///
        /// Deliveries of one ordering key reach the handler in order, one at
        /// a time, retries included (see [`RabbitConsumer`](crate::RabbitConsumer)).
        ///
        /// Do not commit or roll back `tx` yourself. On PostgreSQL, return
        /// every SQL error you meet: a statement that failed aborts the
        /// transaction, and a handler that swallows it and returns `Ok` is
        /// treated as failed.
        ///
        /// Closures work through [`handler_fn`].
        #[async_trait]
        pub trait InboxHandler<Tx: ?Sized + Send $($default)*>: Send + Sync + 'static {
            /// Handles one message within the inbox transaction `tx`.
            async fn handle(&self, msg: &Received, tx: &mut Tx) -> Result<(), HandlerError>;
        }
    };
}

#[cfg(feature = "sqlite-inbox")]
inbox_handler_trait!(= SqliteConnection);
#[cfg(not(feature = "sqlite-inbox"))]
inbox_handler_trait!();

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
/// connection type the closure takes (`SqliteConnection` or
/// `PgConnection`):
///
/// ```no_run
/// # #[cfg(feature = "sqlite-inbox")] {
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
/// # let _ = handler; }
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
