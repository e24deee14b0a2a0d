//! The memory store under the conformance suite (feature `testing`).

use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::testing::StoreUnderTest;
use outbox_api::{MessageId, NewMessage, OperatorStore, Result};

use crate::MemoryStore;

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
