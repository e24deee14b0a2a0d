//! The memory store and inbox under the conformance suites (feature `testing`).

use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::testing::{InboxUnderTest, StoreUnderTest};
use outbox_api::{Error, HandlerError, MessageId, NewMessage, OperatorStore, Result, Store};

use crate::{MemoryInbox, MemoryStore, MemoryTransaction};

#[async_trait]
impl StoreUnderTest for MemoryStore {
    fn store(&self) -> Arc<dyn OperatorStore> {
        Arc::new(self.clone())
    }

    async fn try_enqueue(&self, messages: Vec<NewMessage>) -> Result<Vec<MessageId>> {
        let mut tx = self.begin();
        let ids = messages
            .into_iter()
            .map(|m| tx.enqueue(m))
            .collect::<Result<Vec<_>>>()?;
        tx.commit()?;
        Ok(ids)
    }

    async fn enqueue_rolled_back(&self, messages: Vec<NewMessage>) {
        let mut tx = self.begin();
        for m in messages {
            tx.enqueue(m).expect("valid message");
        }
        tx.rollback();
    }
}

#[async_trait]
impl InboxUnderTest for MemoryInbox {
    type Inbox = MemoryInbox;

    fn inbox(&self) -> &MemoryInbox {
        self
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store().clone())
    }

    async fn enqueue_in(
        &self,
        conn: &mut MemoryTransaction,
        message: NewMessage,
    ) -> std::result::Result<(), HandlerError> {
        conn.enqueue(message)?;
        Ok(())
    }

    fn driver_unavailable_error(&self) -> HandlerError {
        // No driver: the store's own error is what a handler meets.
        Error::unavailable("the memory store is unavailable").into()
    }
}
