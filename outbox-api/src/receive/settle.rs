//! What to do with a delivery after one try, and the attempts counted so
//! far.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{Pending, backoff};
use crate::{InboxOutcome, MessageId};

/// How a consumer retries: counted attempts before the dead letter, the
/// delay between them, and the backoff of uncounted retries (outages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryRules {
    /// Handler failures before the delivery is dead-lettered.
    pub max_attempts: u32,
    /// The delay before trying a failed delivery again.
    pub retry_delay: Duration,
    /// First and longest delay of the uncounted retries (handler
    /// temporarily unavailable, database failing), growing per consecutive
    /// deferral.
    pub unavailable_backoff: (Duration, Duration),
}

/// What to do with a delivery after one try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// Committed: acknowledge it.
    Ack,
    /// Found in the inbox: acknowledge it, the handler did not run.
    AckDuplicate,
    /// The handler failed on its last attempt: dead-letter it.
    DeadLetter {
        /// The handler's error.
        error: String,
    },
    /// The handler failed, a counted attempt: try it again in place after
    /// `delay` (later deliveries of its key wait).
    Retry {
        /// The handler's error.
        error: String,
        /// When to try again.
        delay: Duration,
    },
    /// Not the message's fault (handler temporarily unavailable, database
    /// failing): try it again after `delay`, uncounted.
    Defer {
        /// Why.
        reason: String,
        /// When to try again.
        delay: Duration,
        /// Whether the database failed (else the handler said it is
        /// temporarily unavailable).
        store: bool,
    },
}

impl RetryRules {
    /// What to do after `pending`'s try ended in `outcome` (its
    /// `received.attempt` being the try's number). An uncounted retry
    /// raises `pending.deferrals` (the backoff's exponent); a counted one
    /// resets it.
    pub fn settle<D>(&self, pending: &mut Pending<D>, outcome: InboxOutcome) -> Settle {
        match outcome {
            InboxOutcome::Committed => Settle::Ack,
            InboxOutcome::Duplicate => Settle::AckDuplicate,
            InboxOutcome::HandlerFailed(error) if pending.received.attempt >= self.max_attempts => {
                Settle::DeadLetter { error }
            }
            InboxOutcome::HandlerFailed(error) => {
                pending.deferrals = 0;
                Settle::Retry {
                    error,
                    delay: self.retry_delay,
                }
            }
            InboxOutcome::HandlerUnavailable {
                reason,
                retry_after,
            } => Settle::Defer {
                reason,
                delay: self
                    .outage_delay(pending)
                    .max(retry_after.unwrap_or_default()),
                store: false,
            },
            InboxOutcome::StoreFailed(reason) => Settle::Defer {
                reason,
                delay: self.outage_delay(pending),
                store: true,
            },
        }
    }

    fn outage_delay<D>(&self, pending: &mut Pending<D>) -> Duration {
        pending.deferrals = pending.deferrals.saturating_add(1);
        let (first, max) = self.unavailable_backoff;
        backoff(first, max, pending.deferrals)
    }
}

/// Handler failures so far in this process, by message id, bounded: past
/// [`Attempts::MAX`] entries the oldest tenth is forgotten (a forgotten
/// message counts from 1 again).
#[derive(Debug, Default)]
pub struct Attempts {
    failures: HashMap<MessageId, (u32, Instant)>,
}

impl Attempts {
    /// Entries kept at most.
    pub const MAX: usize = 10_000;

    /// The number of the next try of `id` (1 if it never failed here).
    pub fn next_try(&self, id: MessageId) -> u32 {
        self.failures.get(&id).map_or(0, |a| a.0) + 1
    }

    /// Records that try `attempt` of `id` failed.
    pub fn failed(&mut self, id: MessageId, attempt: u32) {
        if self.failures.len() >= Self::MAX {
            let mut by_age: Vec<(Instant, MessageId)> = self
                .failures
                .iter()
                .map(|(id, (_, at))| (*at, *id))
                .collect();
            by_age.sort();
            for (_, old) in by_age.into_iter().take(Self::MAX / 10) {
                self.failures.remove(&old);
            }
        }
        self.failures.insert(id, (attempt, Instant::now()));
    }

    /// Forgets `id` (settled).
    pub fn settled(&mut self, id: MessageId) {
        self.failures.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::receive::lanes::pending;

    #[test]
    fn settling_follows_the_outcome_and_the_attempt() {
        let rules = RetryRules {
            max_attempts: 3,
            retry_delay: Duration::from_millis(40),
            unavailable_backoff: (Duration::from_millis(100), Duration::from_secs(1)),
        };
        let mut p = pending(1, None);
        assert_eq!(rules.settle(&mut p, InboxOutcome::Committed), Settle::Ack);
        assert_eq!(
            rules.settle(&mut p, InboxOutcome::Duplicate),
            Settle::AckDuplicate
        );
        p.received.attempt = 2;
        assert_eq!(
            rules.settle(&mut p, InboxOutcome::HandlerFailed("no".into())),
            Settle::Retry {
                error: "no".into(),
                delay: Duration::from_millis(40)
            }
        );
        p.received.attempt = 3;
        assert_eq!(
            rules.settle(&mut p, InboxOutcome::HandlerFailed("no".into())),
            Settle::DeadLetter { error: "no".into() }
        );
        // Uncounted retries back off, growing per deferral; a handler's own
        // delay wins when longer.
        let first = rules.settle(&mut p, InboxOutcome::StoreFailed("down".into()));
        assert!(
            matches!(first, Settle::Defer { store: true, delay, .. } if delay <= Duration::from_millis(120)),
            "{first:?}"
        );
        let second = rules.settle(
            &mut p,
            InboxOutcome::HandlerUnavailable {
                reason: "later".into(),
                retry_after: Some(Duration::from_secs(5)),
            },
        );
        assert_eq!(p.deferrals, 2);
        assert!(
            matches!(second, Settle::Defer { store: false, delay, .. } if delay == Duration::from_secs(5)),
            "{second:?}"
        );
        p.received.attempt = 1;
        rules.settle(&mut p, InboxOutcome::HandlerFailed("x".into()));
        assert_eq!(
            p.deferrals, 0,
            "a counted failure resets the outage backoff"
        );
    }

    #[test]
    fn attempts_count_per_message_and_stay_bounded() {
        let mut a = Attempts::default();
        let id = MessageId::new();
        assert_eq!(a.next_try(id), 1);
        a.failed(id, 1);
        assert_eq!(a.next_try(id), 2);
        a.settled(id);
        assert_eq!(a.next_try(id), 1);
        for _ in 0..Attempts::MAX + 5 {
            a.failed(MessageId::new(), 1);
        }
        assert!(a.failures.len() <= Attempts::MAX);
    }
}
