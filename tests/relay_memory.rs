//! The relay rules of DESIGN §5 on the in-memory backend.

mod semantics;

use std::sync::Arc;

use async_trait::async_trait;
use outbox::memory::MemoryStore;
use outbox::testing::StoreUnderTest;
use outbox::{ManualClock, MessageId, NewMessage, OperatorStore, Result};

struct Mem(MemoryStore);

#[async_trait]
impl StoreUnderTest for Mem {
    fn store(&self) -> Arc<dyn OperatorStore> {
        Arc::new(self.0.clone())
    }
    async fn try_enqueue(&self, messages: Vec<NewMessage>) -> Result<Vec<MessageId>> {
        let mut tx = self.0.begin();
        let ids = messages
            .into_iter()
            .map(|m| tx.enqueue(m))
            .collect::<Result<Vec<_>>>()?;
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

struct Memory;

impl semantics::Backend for Memory {
    async fn fresh(clock: Arc<ManualClock>) -> semantics::Fixture {
        Box::new(Mem(MemoryStore::with_clock(clock)))
    }
}

semantics_tests!(Memory);
