//! A fleet's delivery slots, shared by its members (rule "Fleets" in
//! `docs/rules.md`).
//!
//! One queue serves every member in the order it asked, and a member asks
//! for one slot at a time (it starts that delivery, then asks again), so a
//! member never has more than one request in the queue: while slots are
//! scarce they go round the members that have work, one delivery each —
//! round robin with a quantum of one delivery. A quiet member's fresh
//! message waits for at most one slot per other busy member, however deep
//! their backlogs. A free slot is only taken at once when nobody waits.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A delivery slot held for as long as its delivery runs.
pub(crate) type Slot = OwnedSemaphorePermit;

/// The slots of a fleet.
#[derive(Debug)]
pub(crate) struct Budget {
    slots: Arc<Semaphore>,
    total: usize,
}

impl Budget {
    pub(crate) fn new(total: usize) -> Self {
        Budget {
            slots: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// A slot now, if one is free and nobody waits for one (a waiting
    /// member is served first: a free slot is handed to it on release).
    pub(crate) fn try_take(&self) -> Option<Slot> {
        Arc::clone(&self.slots).try_acquire_owned().ok()
    }

    /// A place in the queue: ready when the slot is this caller's. Dropping
    /// it gives the place up.
    pub(crate) fn wait(&self) -> impl Future<Output = Slot> + Send + 'static {
        let slots = Arc::clone(&self.slots);
        async move {
            slots
                .acquire_owned()
                .await
                .expect("a fleet's slots are never closed")
        }
    }

    /// Slots held by deliveries now.
    pub(crate) fn in_use(&self) -> usize {
        self.total - self.slots.available_permits()
    }

    /// All slots.
    pub(crate) fn total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;

    #[tokio::test]
    async fn a_free_slot_goes_to_the_member_that_waited_not_to_the_one_that_asks_later() {
        let budget = Budget::new(1);
        let held = budget.try_take().expect("one slot is free");
        assert_eq!(budget.in_use(), 1);
        assert!(budget.try_take().is_none(), "no slot is free");
        let mut quiet = Box::pin(budget.wait());
        assert!((&mut quiet).now_or_never().is_none(), "it waits");
        drop(held);
        // The busy member asks again at once: the slot is the quiet one's.
        assert!(budget.try_take().is_none(), "the waiting member goes first");
        let slot = quiet.await;
        assert_eq!(budget.in_use(), 1);
        drop(slot);
        assert_eq!(budget.in_use(), 0);
        assert!(budget.try_take().is_some());
    }

    #[tokio::test]
    async fn a_place_given_up_passes_the_slot_to_the_next() {
        let budget = Budget::new(1);
        let held = budget.try_take().unwrap();
        let mut first = Box::pin(budget.wait());
        let mut second = Box::pin(budget.wait());
        // A place is taken when the wait is first polled.
        assert!((&mut first).now_or_never().is_none());
        assert!((&mut second).now_or_never().is_none());
        drop(first);
        drop(held);
        let _slot = second.await;
        assert_eq!(budget.total(), 1);
    }
}
