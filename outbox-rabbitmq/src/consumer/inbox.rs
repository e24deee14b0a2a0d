//! The inbox behind a consumer: any store's [`outbox_api::Inbox`] bound to
//! the application's [`InboxHandler`] on that store's connection type, and
//! erased to one type, so that the consume loop, settling and the purge are
//! written once for every store.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{HandlerError, InboxOutcome, InboxWork, Result, Timestamp};

use super::{InboxHandler, Received};

/// A store's inbox with the handler that runs in its transactions.
#[derive(Clone)]
pub(super) struct Inbox(Arc<dyn Receiver>);

impl Inbox {
    /// Binds `handler` to `inbox`.
    pub(super) fn bind<I: outbox_api::Inbox>(
        inbox: I,
        handler: Arc<dyn InboxHandler<I::Conn>>,
    ) -> Self {
        Inbox(Arc::new(Bound { inbox, handler }))
    }

    /// The inbox table, for logs.
    pub(super) fn table(&self) -> String {
        self.0.table()
    }

    /// The inbox transaction around the handler for `received`.
    pub(super) async fn receive_once(
        &self,
        consumer: &str,
        received: &Received,
        handler_timeout: Duration,
    ) -> InboxOutcome {
        self.0
            .receive_once(consumer, received, handler_timeout)
            .await
    }

    /// Deletes at most `limit` entries received before `before`.
    pub(super) async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64> {
        self.0.purge(before, limit).await
    }
}

#[async_trait]
trait Receiver: Send + Sync {
    fn table(&self) -> String;
    async fn receive_once(
        &self,
        consumer: &str,
        received: &Received,
        handler_timeout: Duration,
    ) -> InboxOutcome;
    async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64>;
}

struct Bound<I: outbox_api::Inbox> {
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
impl<I: outbox_api::Inbox> Receiver for Bound<I> {
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
