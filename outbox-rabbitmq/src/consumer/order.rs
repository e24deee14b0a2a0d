//! Per-key order on retry: the deliveries the consumer holds back, by
//! ordering key, while the first of them waits to be tried again.
//!
//! A lane is one ordering key (or, for a message without a key, that one
//! delivery alone). While a lane's head waits for its retry, later
//! deliveries of the same key queue behind it here, in arrival order; other
//! lanes go on. When the head is settled (acknowledged or dead-lettered),
//! the ones behind it run in order.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use lapin::message::Delivery;
use tokio::task::JoinSet;

use super::Received;

/// The lane of a delivery: its ordering key, or itself alone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Lane {
    /// Deliveries with this ordering key (header `x-outbox-key`).
    Key(String),
    /// A delivery without a key (its delivery tag): orders nothing else.
    Alone(u64),
}

impl Lane {
    pub(super) fn of(pending: &Pending) -> Lane {
        match &pending.received.key {
            Some(key) => Lane::Key(key.clone()),
            None => Lane::Alone(pending.delivery.delivery_tag),
        }
    }
}

/// A decoded delivery not settled yet.
pub(super) struct Pending {
    pub(super) delivery: Delivery,
    pub(super) received: Received,
    /// Consecutive uncounted retries (handler unavailable, database
    /// failing): the exponent of the outage backoff.
    pub(super) deferrals: u32,
}

/// One held lane: the delivery waiting for its retry (`None` while it
/// runs) and the later ones of its key.
struct Queue {
    head: Option<Pending>,
    behind: VecDeque<Pending>,
}

/// Every held lane and the timers of their heads. Bounded by the prefetch:
/// each held delivery keeps its unacknowledged slot.
#[derive(Default)]
pub(super) struct Held {
    lanes: HashMap<Lane, Queue>,
    /// One timer per held head; each yields its lane when due.
    timers: JoinSet<Lane>,
}

impl Held {
    /// Whether `lane` has a delivery waiting (later ones must queue behind).
    pub(super) fn holds(&self, lane: &Lane) -> bool {
        self.lanes.contains_key(lane)
    }

    /// Queues `pending` behind the held deliveries of its lane.
    pub(super) fn queue_behind(&mut self, lane: Lane, pending: Pending) {
        self.lanes
            .entry(lane)
            .or_insert_with(|| Queue {
                head: None,
                behind: VecDeque::new(),
            })
            .behind
            .push_back(pending);
    }

    /// Holds `pending` at the head of its lane, due again after `delay`.
    pub(super) fn hold(&mut self, lane: Lane, pending: Pending, delay: Duration) {
        let queue = self.lanes.entry(lane.clone()).or_insert_with(|| Queue {
            head: None,
            behind: VecDeque::new(),
        });
        queue.head = Some(pending);
        self.timers.spawn(async move {
            tokio::time::sleep(delay).await;
            lane
        });
    }

    /// The next lane whose head is due; `None` when no timer runs.
    pub(super) async fn due(&mut self) -> Option<Lane> {
        loop {
            match self.timers.join_next().await? {
                Ok(lane) => return Some(lane),
                // Aborted or panicked timers (none are expected): skip.
                Err(_) => continue,
            }
        }
    }

    /// Takes the head of `lane` out to run it; the lane stays held.
    pub(super) fn take_head(&mut self, lane: &Lane) -> Option<Pending> {
        self.lanes.get_mut(lane)?.head.take()
    }

    /// The next delivery behind `lane`'s settled head, in arrival order;
    /// `None` (and the lane is released) when there is none.
    pub(super) fn next_behind(&mut self, lane: &Lane) -> Option<Pending> {
        let queue = self.lanes.get_mut(lane)?;
        let next = queue.behind.pop_front();
        if next.is_none() && queue.head.is_none() {
            self.lanes.remove(lane);
        }
        next
    }

    /// Deliveries held right now.
    pub(super) fn len(&self) -> usize {
        self.lanes
            .values()
            .map(|q| q.behind.len() + usize::from(q.head.is_some()))
            .sum()
    }

    /// Forgets everything (the channel is closed: the broker requeues every
    /// unacknowledged delivery, in order) and stops the timers.
    pub(super) fn clear(&mut self) {
        self.lanes.clear();
        // Dropping a JoinSet aborts its tasks; a timer that finished before
        // could otherwise still yield its lane.
        self.timers = JoinSet::new();
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    use outbox_api::MessageId;

    use super::*;
    use crate::KEY_HEADER;

    fn pending(tag: u64, key: Option<&str>) -> Pending {
        let mut headers = FieldTable::default();
        if let Some(key) = key {
            headers.insert(
                ShortString::from(KEY_HEADER),
                AMQPValue::LongString(LongString::from(key)),
            );
        }
        let mut delivery = Delivery::mock(tag, "".into(), "q".into(), false, vec![]);
        delivery.properties = lapin::BasicProperties::default()
            .with_message_id(ShortString::from(MessageId::new().to_string()))
            .with_headers(headers);
        Pending {
            received: Received::decode(&delivery).unwrap(),
            delivery,
            deferrals: 0,
        }
    }

    #[test]
    fn a_delivery_without_a_key_is_its_own_lane() {
        assert_eq!(Lane::of(&pending(7, Some("K"))), Lane::Key("K".into()));
        assert_eq!(Lane::of(&pending(7, None)), Lane::Alone(7));
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

        assert_eq!(held.due().await, Some(k.clone()));
        let head = held.take_head(&k).unwrap();
        assert_eq!(head.delivery.delivery_tag, 1);
        assert!(held.holds(&k), "still held while its head runs");
        let tags: Vec<u64> = std::iter::from_fn(|| held.next_behind(&k))
            .map(|p| p.delivery.delivery_tag)
            .collect();
        assert_eq!(tags, vec![2, 3]);
        assert!(!held.holds(&k), "released once empty");
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
}
