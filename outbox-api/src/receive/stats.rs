//! What a consumer did: [`ConsumerStats`] and the live [`Counters`].

use std::sync::atomic::{AtomicU64, Ordering};

use super::Settle;

/// What a consumer did since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Deliveries handled and committed (then acknowledged).
    pub handled: u64,
    /// Deliveries found in the inbox already: acknowledged, handler not run.
    pub duplicates: u64,
    /// Handler failures (counted attempts) tried again in place after
    /// the retry delay.
    pub retried: u64,
    /// Deliveries dead-lettered after `max_attempts` handler failures.
    pub dead_lettered: u64,
    /// Deliveries dead-lettered because they carry no valid message id.
    pub invalid: u64,
    /// Database failures (not counted as attempts): the delivery was tried
    /// again after the outage backoff.
    pub store_errors: u64,
    /// Tries whose handler said
    /// [`TemporarilyUnavailable`](crate::TemporarilyUnavailable): the
    /// delivery was tried again after the outage backoff, not counted as
    /// an attempt.
    pub deferred: u64,
    /// Deliveries held back behind an earlier delivery of their ordering
    /// key that was waiting for its retry (per-key order).
    pub held_back: u64,
    /// Connections (or subscriptions) opened after the first one.
    pub reconnects: u64,
    /// Standby partitions this consumer took over because no other
    /// consumer was on them.
    pub takeovers: u64,
    /// Standby partitions it handed back because another consumer waited.
    pub handovers: u64,
}

/// The live counters behind [`ConsumerStats`], shared by a consumer's
/// tasks.
#[derive(Debug, Default)]
pub struct Counters {
    /// See [`ConsumerStats::handled`].
    pub handled: AtomicU64,
    /// See [`ConsumerStats::duplicates`].
    pub duplicates: AtomicU64,
    /// See [`ConsumerStats::retried`].
    pub retried: AtomicU64,
    /// See [`ConsumerStats::dead_lettered`].
    pub dead_lettered: AtomicU64,
    /// See [`ConsumerStats::invalid`].
    pub invalid: AtomicU64,
    /// See [`ConsumerStats::store_errors`].
    pub store_errors: AtomicU64,
    /// See [`ConsumerStats::deferred`].
    pub deferred: AtomicU64,
    /// See [`ConsumerStats::held_back`].
    pub held_back: AtomicU64,
    /// See [`ConsumerStats::reconnects`].
    pub reconnects: AtomicU64,
    /// See [`ConsumerStats::takeovers`].
    pub takeovers: AtomicU64,
    /// See [`ConsumerStats::handovers`].
    pub handovers: AtomicU64,
}

/// Adds one to `counter`.
pub fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    /// The counts now.
    pub fn stats(&self) -> ConsumerStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            handled: get(&self.handled),
            duplicates: get(&self.duplicates),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            invalid: get(&self.invalid),
            store_errors: get(&self.store_errors),
            deferred: get(&self.deferred),
            held_back: get(&self.held_back),
            reconnects: get(&self.reconnects),
            takeovers: get(&self.takeovers),
            handovers: get(&self.handovers),
        }
    }

    /// Counts what [`Settle`] decided.
    pub fn count(&self, settle: &Settle) {
        bump(match settle {
            Settle::Ack => &self.handled,
            Settle::AckDuplicate => &self.duplicates,
            Settle::DeadLetter { .. } => &self.dead_lettered,
            Settle::Retry { .. } => &self.retried,
            Settle::Defer { store: true, .. } => &self.store_errors,
            Settle::Defer { store: false, .. } => &self.deferred,
        });
    }
}
