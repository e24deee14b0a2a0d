//! The deliveries held back per ordering key while the first of them waits
//! for its retry.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::Duration;

use tokio::task::JoinSet;

use super::Received;

/// The lane of a delivery: its ordering key, or itself alone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Deliveries with this ordering key.
    Key(String),
    /// A delivery without a key (its broker tag or sequence): orders
    /// nothing else.
    Alone(u64),
}

impl Lane {
    /// The lane of `received`; `tag` tells a keyless delivery apart (an
    /// AMQP delivery tag, a stream sequence).
    pub fn of(received: &Received, tag: u64) -> Lane {
        match &received.key {
            Some(key) => Lane::Key(key.clone()),
            None => Lane::Alone(tag),
        }
    }
}

/// A decoded delivery not settled yet; `D` is the broker's delivery (what
/// acknowledges it).
#[derive(Debug)]
pub struct Pending<D> {
    /// The broker's delivery.
    pub delivery: D,
    /// What it says.
    pub received: Received,
    /// Consecutive uncounted retries (handler unavailable, database
    /// failing): the exponent of the outage backoff.
    pub deferrals: u32,
}

impl<D> Pending<D> {
    /// A delivery not tried yet.
    pub fn new(delivery: D, received: Received) -> Self {
        Pending {
            delivery,
            received,
            deferrals: 0,
        }
    }
}

/// One held lane: the delivery waiting for its retry (`None` while it
/// runs) and the later ones of its key.
struct Queue<D> {
    head: Option<Pending<D>>,
    behind: VecDeque<Pending<D>>,
}

impl<D> Default for Queue<D> {
    fn default() -> Self {
        Queue {
            head: None,
            behind: VecDeque::new(),
        }
    }
}

/// Every held lane and the timers of their heads. A lane is one ordering
/// key (or one keyless delivery): while its head waits for its retry, later
/// deliveries of the same key queue behind it in arrival order; other lanes
/// go on. When the head is settled, the ones behind it run in order.
/// Bounded by the broker's prefetch: each held delivery keeps its
/// unacknowledged slot.
pub struct Held<D> {
    lanes: HashMap<Lane, Queue<D>>,
    /// One timer per held head; each yields its lane when due.
    timers: JoinSet<Lane>,
}

impl<D> Default for Held<D> {
    fn default() -> Self {
        Held {
            lanes: HashMap::new(),
            timers: JoinSet::new(),
        }
    }
}

impl<D> fmt::Debug for Held<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("lanes", &self.lanes.len())
            .field("deliveries", &self.len())
            .finish()
    }
}

impl<D> Held<D> {
    /// Whether `lane` has a delivery waiting (later ones must queue behind).
    pub fn holds(&self, lane: &Lane) -> bool {
        self.lanes.contains_key(lane)
    }

    /// Queues `pending` behind the held deliveries of its lane.
    pub fn queue_behind(&mut self, lane: Lane, pending: Pending<D>) {
        self.lanes
            .entry(lane)
            .or_default()
            .behind
            .push_back(pending);
    }

    /// Holds `pending` at the head of its lane, due again after `delay`.
    ///
    /// # Panics
    /// Outside a tokio runtime (the timer is a task).
    pub fn hold(&mut self, lane: Lane, pending: Pending<D>, delay: Duration) {
        self.lanes.entry(lane.clone()).or_default().head = Some(pending);
        self.timers.spawn(async move {
            tokio::time::sleep(delay).await;
            lane
        });
    }

    /// The next lane whose head is due; `None` when no timer runs.
    pub async fn due(&mut self) -> Option<Lane> {
        loop {
            match self.timers.join_next().await? {
                Ok(lane) => return Some(lane),
                // Aborted or panicked timers (none are expected): skip.
                Err(_) => continue,
            }
        }
    }

    /// Takes the head of `lane` out to run it; the lane stays held.
    pub fn take_head(&mut self, lane: &Lane) -> Option<Pending<D>> {
        self.lanes.get_mut(lane)?.head.take()
    }

    /// The next delivery behind `lane`'s settled head, in arrival order;
    /// `None` (and the lane is released) when there is none.
    pub fn next_behind(&mut self, lane: &Lane) -> Option<Pending<D>> {
        let queue = self.lanes.get_mut(lane)?;
        let next = queue.behind.pop_front();
        if next.is_none() && queue.head.is_none() {
            self.lanes.remove(lane);
        }
        next
    }

    /// Deliveries held right now.
    pub fn len(&self) -> usize {
        self.lanes
            .values()
            .map(|q| q.behind.len() + usize::from(q.head.is_some()))
            .sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// Every held delivery, heads first, lane by lane.
    pub fn deliveries(&self) -> impl Iterator<Item = &Pending<D>> {
        self.lanes
            .values()
            .flat_map(|q| q.head.iter().chain(q.behind.iter()))
    }

    /// Takes every held delivery out (heads first, lane by lane; sort them
    /// if the broker needs them in its order) and stops the timers: for a
    /// consumer that gives them back to the broker explicitly.
    pub fn take_all(&mut self) -> Vec<Pending<D>> {
        let all = self
            .lanes
            .drain()
            .flat_map(|(_, q)| q.head.into_iter().chain(q.behind))
            .collect();
        self.timers = JoinSet::new();
        all
    }

    /// Forgets everything (the broker gives unacknowledged deliveries back
    /// by itself) and stops the timers.
    pub fn clear(&mut self) {
        self.lanes.clear();
        // Dropping a JoinSet aborts its tasks; a timer that finished before
        // could otherwise still yield its lane.
        self.timers = JoinSet::new();
    }
}

/// A delivery tagged `tag` with ordering key `key`, for this module's and
/// its siblings' unit tests.
#[cfg(test)]
pub(super) fn pending(tag: u64, key: Option<&str>) -> Pending<u64> {
    let mut received = Received::new(crate::MessageId::new(), Vec::new());
    received.key = key.map(str::to_owned);
    Pending::new(tag, received)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_without_a_key_is_its_own_lane() {
        let p = pending(7, Some("K"));
        assert_eq!(Lane::of(&p.received, 7), Lane::Key("K".into()));
        let p = pending(7, None);
        assert_eq!(Lane::of(&p.received, 7), Lane::Alone(7));
    }

    #[tokio::test]
    async fn a_held_lane_releases_its_deliveries_in_arrival_order() {
        let mut held = Held::default();
        let k = Lane::Key("K".into());
        held.hold(k.clone(), pending(1, Some("K")), Duration::from_millis(1));
        assert!(held.holds(&k));
        assert!(!held.holds(&Lane::Key("L".into())), "other keys go on");
        held.queue_behind(k.clone(), pending(2, Some("K")));
        held.queue_behind(k.clone(), pending(3, Some("K")));
        assert_eq!(held.len(), 3);
        assert_eq!(held.deliveries().count(), 3);

        assert_eq!(held.due().await, Some(k.clone()));
        let head = held.take_head(&k).unwrap();
        assert_eq!(head.delivery, 1);
        assert!(held.holds(&k), "still held while its head runs");
        let tags: Vec<u64> = std::iter::from_fn(|| held.next_behind(&k))
            .map(|p| p.delivery)
            .collect();
        assert_eq!(tags, vec![2, 3]);
        assert!(!held.holds(&k), "released once empty");
        assert!(held.is_empty());
        assert_eq!(held.due().await, None, "no timer left");
    }

    #[tokio::test]
    async fn clearing_forgets_deliveries_and_timers() {
        let mut held = Held::default();
        let k = Lane::Key("K".into());
        held.hold(k.clone(), pending(1, Some("K")), Duration::ZERO);
        held.queue_behind(k.clone(), pending(2, Some("K")));
        tokio::task::yield_now().await;
        held.clear();
        assert_eq!(held.len(), 0);
        assert!(!held.holds(&k));
        assert_eq!(held.due().await, None);
    }

    #[tokio::test]
    async fn taking_all_gives_every_held_delivery_and_stops_the_timers() {
        let mut held = Held::default();
        let k = Lane::Key("K".into());
        held.hold(k.clone(), pending(1, Some("K")), Duration::from_secs(60));
        held.queue_behind(k.clone(), pending(3, Some("K")));
        held.hold(Lane::Alone(2), pending(2, None), Duration::ZERO);
        let mut tags: Vec<u64> = held.take_all().into_iter().map(|p| p.delivery).collect();
        tags.sort_unstable();
        assert_eq!(tags, vec![1, 2, 3]);
        assert!(held.is_empty() && !held.holds(&k));
        assert_eq!(held.due().await, None, "no timer left");
    }
}
