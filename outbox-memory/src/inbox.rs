//! [`MemoryInbox`]: the [`Inbox`] contract on a [`MemoryStore`], for tests
//! of receivers and handlers with no database.

use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{Inbox, InboxOutcome, InboxWork, MessageId, Result, Timestamp, run_inbox_handler};

use crate::{MemoryStore, MemoryTransaction};

/// The inbox of a [`MemoryStore`]: each message runs in a
/// [`MemoryTransaction`] that records the inbox entry and holds the
/// handler's enqueued replies, all committed together (see [`Inbox`]).
#[derive(Debug, Clone)]
pub struct MemoryInbox {
    store: MemoryStore,
}

impl MemoryInbox {
    /// The inbox of `store` (its replies are enqueued in `store`).
    pub fn new(store: MemoryStore) -> Self {
        MemoryInbox { store }
    }

    /// The store this inbox records in.
    pub fn store(&self) -> &MemoryStore {
        &self.store
    }
}

#[async_trait]
impl Inbox for MemoryInbox {
    type Conn = MemoryTransaction;

    fn name(&self) -> String {
        "memory inbox".to_owned()
    }

    async fn receive_once(
        &self,
        consumer: &str,
        message_id: MessageId,
        handler_timeout: Duration,
        work: &dyn InboxWork<MemoryTransaction>,
    ) -> InboxOutcome {
        let mut tx = self.store.begin();
        if !tx.try_receive(consumer, message_id) {
            return InboxOutcome::Duplicate;
        }
        // No driver here: only `outbox_api::Error`s of kind `Unavailable`
        // are the store being unavailable.
        if let Some(outcome) =
            run_inbox_handler(handler_timeout, work.run(&mut tx), |_| false).await
        {
            return outcome;
        }
        match tx.commit() {
            Ok(()) => InboxOutcome::Committed,
            // Another transaction recorded it meanwhile: handled there.
            Err(_) if self.store.inbox_contains(consumer, message_id) => InboxOutcome::Duplicate,
            Err(e) => InboxOutcome::HandlerFailed(outbox_api::error_chain(&e)),
        }
    }

    async fn purge(&self, before: Timestamp, limit: usize) -> Result<u64> {
        Ok(self.store.purge_inbox(before, limit))
    }
}
