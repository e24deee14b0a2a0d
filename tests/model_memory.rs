//! The model-based property test on the memory backend.

mod model;

use std::sync::Arc;

use async_trait::async_trait;
use outbox::memory::MemoryStore;
use outbox::testing::StoreUnderTest;
use outbox::{MessageId, NewMessage, OperatorStore, Result};
use proptest::prelude::*;

struct Mem(MemoryStore);

#[async_trait]
impl StoreUnderTest for Mem {
    fn store(&self) -> Arc<dyn OperatorStore> {
        Arc::new(self.0.clone())
    }
    async fn try_enqueue(&self, messages: Vec<NewMessage>) -> Result<Vec<MessageId>> {
        let mut tx = self.0.begin();
        let ids = messages.into_iter().map(|m| tx.enqueue(m)).collect::<Result<Vec<_>>>()?;
        tx.commit()?;
        Ok(ids)
    }
    async fn enqueue_rolled_back(&self, messages: Vec<NewMessage>) {
        let mut tx = self.0.begin();
        for m in messages {
            tx.enqueue(m).unwrap();
        }
        tx.rollback();
    }
}

proptest! {
    #![proptest_config(model::config())]
    #[test]
    fn relay_keeps_its_guarantees_on_memory(batch_size in 1usize..6, ops in model::ops()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let clock = model::clock();
            let store = MemoryStore::with_clock(clock.clone());
            model::run_case(Box::new(Mem(store)), clock, batch_size, ops).await;
        });
    }
}
