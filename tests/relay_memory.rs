//! The relay rules of `docs/rules.md` on the in-memory backend.

mod semantics;

use std::sync::Arc;

use outbox::ManualClock;
use outbox::memory::MemoryStore;

struct Memory;

impl semantics::Backend for Memory {
    async fn fresh(clock: Arc<ManualClock>) -> semantics::Fixture {
        Box::new(MemoryStore::with_clock(clock))
    }
}

semantics_tests!(Memory);
semantics_tests!(Memory, in_a_fleet);
