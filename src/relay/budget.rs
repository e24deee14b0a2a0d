//! A fleet's delivery slots, shared by its members (rule "Fleets" in
//! `docs/rules.md`).
//!
//! One queue serves every member in the order it asked, and a member asks
//! for one turn at a time (it starts those deliveries, then asks again), so
//! a member never has more than one request in the queue: while slots are
//! scarce they go round the members that have work, a turn each — weighted
//! round robin, a turn being as many deliveries as the member's weight (one
//! by default). A quiet member's fresh message waits for at most one turn
//! per other busy member, however deep their backlogs. A free slot is only
//! taken at once when nobody waits.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

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

    /// A place in the queue for a turn of `slots` slots (at least one, at
    /// most all): ready when they are this caller's, as one permit to
    /// [`split`](Slot::split). Dropping it gives the place up, and any
    /// slot handed to it meanwhile to the next in the queue.
    pub(crate) fn wait(&self, slots: usize) -> impl Future<Output = Slot> + Send + 'static {
        let n = slots.clamp(1, self.total) as u32;
        let semaphore = Arc::clone(&self.slots);
        async move {
            semaphore
                .acquire_many_owned(n)
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

/// A relay's place in a fleet: the fleet's slots, and its weight — the
/// slots it takes per turn while they are scarce.
#[derive(Debug)]
pub(crate) struct Member {
    budget: Arc<Budget>,
    weight: AtomicU32,
}

impl Member {
    pub(crate) fn new(budget: Arc<Budget>, weight: u32) -> Self {
        Member {
            budget,
            weight: AtomicU32::new(weight),
        }
    }

    pub(crate) fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Slots per turn: the weight, never more than the fleet has.
    pub(crate) fn turn(&self) -> usize {
        (self.weight() as usize).clamp(1, self.budget.total())
    }

    /// The weight as set (it may exceed the fleet's slots).
    pub(crate) fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    /// Sets the weight; the next turn asked for takes it.
    pub(crate) fn set_weight(&self, weight: u32) {
        self.weight.store(weight, Ordering::Relaxed);
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
        let mut quiet = Box::pin(budget.wait(1));
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
        let mut first = Box::pin(budget.wait(1));
        let mut second = Box::pin(budget.wait(1));
        // A place is taken when the wait is first polled.
        assert!((&mut first).now_or_never().is_none());
        assert!((&mut second).now_or_never().is_none());
        drop(first);
        drop(held);
        let _slot = second.await;
        assert_eq!(budget.total(), 1);
    }

    #[tokio::test]
    async fn a_turn_of_a_heavier_member_takes_as_many_slots_as_its_weight_then_the_next_gets_its_own()
     {
        let budget = Budget::new(4);
        let held: Vec<Slot> = (0..4).map(|_| budget.try_take().unwrap()).collect();
        let mut heavy = Box::pin(budget.wait(3));
        let mut light = Box::pin(budget.wait(1));
        assert!((&mut heavy).now_or_never().is_none());
        assert!((&mut light).now_or_never().is_none());
        let mut held = held.into_iter();
        // Slots freed one by one go to the heavy turn until it has three,
        // while the light member, queued behind it, waits.
        drop(held.next());
        drop(held.next());
        assert!((&mut heavy).now_or_never().is_none());
        assert!((&mut light).now_or_never().is_none());
        drop(held.next());
        let mut turn = heavy.await;
        assert_eq!(turn.num_permits(), 3);
        assert!((&mut light).now_or_never().is_none(), "no slot is free yet");
        drop(held.next());
        let _light = light.await;
        // A turn is used a slot at a time; what is left of it goes back.
        let one = turn.split(1).unwrap();
        assert_eq!((turn.num_permits(), one.num_permits()), (2, 1));
        drop(turn);
        assert_eq!(budget.in_use(), 2);
        // A turn never asks for more slots than the fleet has.
        let all = budget.wait(10);
        drop((one, _light));
        assert_eq!(all.await.num_permits(), 4);
    }

    #[test]
    fn a_members_turn_is_its_weight_within_the_fleets_slots() {
        let member = Member::new(Arc::new(Budget::new(4)), 3);
        assert_eq!((member.weight(), member.turn()), (3, 3));
        member.set_weight(9);
        assert_eq!((member.weight(), member.turn()), (9, 4));
    }
}
