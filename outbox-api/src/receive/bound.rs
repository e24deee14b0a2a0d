//! The inbox behind a consumer: any store's [`Inbox`](crate::Inbox) bound
//! to the application's [`InboxHandler`] on that store's connection type,
//! and erased to one type, so that a consumer's loop, settling and purge
//! are written once for every store.

use std::sync::Arc;
use std::time::Duration;

use crate::{HandlerError, InboxOutcome, InboxWork, Result, Timestamp};
use async_trait::async_trait;

use super::{InboxHandler, Received};

/// A store's inbox with the handler that runs in its transactions, one
/// type for every store.
pub type BoundInbox = Arc<dyn Receiver>;

/// Binds `handler` to `inbox`.
pub fn bind<I: crate::Inbox>(inbox: I, handler: Arc<dyn InboxHandler<I::Conn>>) -> BoundInbox {
    Arc::new(Bound { inbox, handler })
}

/// What the consume loop, settling and the purge ask of the bound inbox.
#[async_trait]
pub trait Receiver: Send + Sync {
    /// The inbox table, for logs.
    fn table(&self) -> String;
    /// The inbox transaction around the handler for `received`.
    async fn receive_once(
        &self,
        consumer: &str,
        received: &Received,
        handler_timeout: Duration,
    ) -> InboxOutcome;
    /// Deletes at most `limit` entries received before `before`.
    async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64>;
}

struct Bound<I: crate::Inbox> {
    inbox: I,
    handler: Arc<dyn InboxHandler<I::Conn>>,
}

/// The handler applied to one delivery: what runs in the inbox transaction.
struct Work<'a, C: ?Sized> {
    handler: &'a dyn InboxHandler<C>,
    received: &'a Received,
}

#[async_trait]
impl<C: ?Sized + Send + 'static> InboxWork<C> for Work<'_, C> {
    async fn run(&self, conn: &mut C) -> std::result::Result<(), HandlerError> {
        self.handler.handle(self.received, conn).await
    }
}

#[async_trait]
impl<I: crate::Inbox> Receiver for Bound<I> {
    fn table(&self) -> String {
        self.inbox.name()
    }

    async fn receive_once(
        &self,
        consumer: &str,
        received: &Received,
        handler_timeout: Duration,
    ) -> InboxOutcome {
        let work = Work {
            handler: &*self.handler,
            received,
        };
        self.inbox
            .receive_once(consumer, received.id, handler_timeout, &work)
            .await
    }

    async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64> {
        self.inbox.purge(before, limit).await
    }
}
