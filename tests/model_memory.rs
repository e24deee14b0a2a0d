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

    /// The same, the relay's slots coming from a fleet of 1–3 slots in
    /// turns of its weight (1–4): turns split, and given back when their
    /// messages' keys are busy.
    #[test]
    fn relay_in_a_fleet_keeps_its_guarantees_on_memory(
        batch_size in 1usize..6,
        slots in 1usize..4,
        weight in 1u32..5,
        ops in model::ops(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let clock = model::clock();
            let store = MemoryStore::with_clock(clock.clone());
            model::run_case_in(Box::new(store), clock, batch_size, ops, Some((slots, weight))).await;
        });
    }
}
