//! The model-based property test on the memory backend.

mod model;

use outbox::memory::MemoryStore;
use proptest::prelude::*;

proptest! {
    #![proptest_config(model::config())]
    #[test]
    fn relay_keeps_its_guarantees_on_memory(batch_size in 1usize..6, ops in model::ops()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let clock = model::clock();
            let store = MemoryStore::with_clock(clock.clone());
            model::run_case(Box::new(store), clock, batch_size, ops).await;
        });
    }
}
