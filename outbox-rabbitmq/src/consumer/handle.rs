//! [`ConsumerHandle`]: a running consumer, its stats and its stop; and the
//! inbox purge beside it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::RabbitConsumerBuilder;
use super::inbox::Inbox;

/// What a consumer did since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Deliveries handled and committed (then acknowledged).
    pub handled: u64,
    /// Deliveries found in the inbox already: acknowledged, handler not run.
    pub duplicates: u64,
    /// Handler failures (counted attempts) tried again in place after
    /// `retry_delay`.
    pub retried: u64,
    /// Deliveries rejected to the dead-letter exchange after `max_attempts`
    /// handler failures.
    pub dead_lettered: u64,
    /// Deliveries rejected to the dead-letter exchange because they have no
    /// valid `message_id`.
    pub invalid: u64,
    /// Database failures (not counted as attempts): the delivery was tried
    /// again after the outage backoff.
    pub store_errors: u64,
    /// Tries whose handler said
    /// [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable): the
    /// delivery was tried again after the outage backoff, not counted as
    /// an attempt.
    pub deferred: u64,
    /// Deliveries held back behind an earlier delivery of their ordering
    /// key that was waiting for its retry (per-key order).
    pub held_back: u64,
    /// Connections opened after the first one.
    pub reconnects: u64,
    /// Standby partitions this consumer took over because no other
    /// consumer was on them (see [`RabbitConsumerBuilder::replica`](crate::RabbitConsumerBuilder::replica)).
    pub takeovers: u64,
    /// Standby partitions it handed back because another consumer waited.
    pub handovers: u64,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) handled: AtomicU64,
    pub(super) duplicates: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    pub(super) invalid: AtomicU64,
    pub(super) store_errors: AtomicU64,
    pub(super) deferred: AtomicU64,
    pub(super) held_back: AtomicU64,
    pub(super) reconnects: AtomicU64,
    pub(super) takeovers: AtomicU64,
    pub(super) handovers: AtomicU64,
}

pub(super) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// One consumed queue's state (a partitioned consumer has one per
/// partition), and the counters of the whole consumer.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) queue: String,
    pub(super) consumer_name: String,
    /// Subscribed to the queue right now.
    pub(super) connected: AtomicBool,
    pub(super) running: AtomicBool,
    /// Consumes this (partition) queue only while no other consumer does.
    pub(super) standby: bool,
    pub(super) counters: Arc<Counters>,
    pub(super) meter: crate::metrics::ConsumerMeter,
}

/// A running [`RabbitConsumer`](crate::RabbitConsumer). Dropping it stops the consumer (without
/// waiting); [`shutdown`](ConsumerHandle::shutdown) stops it gracefully.
#[derive(Debug)]
pub struct ConsumerHandle {
    pub(super) shutdown: watch::Sender<bool>,
    pub(super) tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    pub(super) purger: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The queue, or the partitions' prefix.
    pub(super) name: String,
    pub(super) consumer_name: String,
    /// One per consumed queue (one per partition when partitioned).
    pub(super) queues: Vec<Arc<Shared>>,
    pub(super) counters: Arc<Counters>,
}

/// Deletes inbox entries older than `retention` every `interval`, in
/// batches that rest between them, until shutdown.
pub(super) async fn purge_inbox_loop(
    inbox: Inbox,
    retention: Duration,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    while !*shutdown.borrow() {
        let before = outbox_api::Timestamp::now().saturating_sub(retention);
        let stop = shutdown.clone();
        let purged = outbox_api::backend::purge_in_batches(
            RabbitConsumerBuilder::INBOX_PURGE_BATCH,
            || *stop.borrow(),
            |limit| inbox.purge(before, limit),
        )
        .await;
        match purged {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(purged = n, table = %inbox.table(), "purged inbox entries past retention")
            }
            Err(e) => tracing::warn!(error = %e, "inbox purge failed; will retry"),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            // The handle is gone (dropped without shutdown): stop too.
            changed = shutdown.changed() => if changed.is_err() { return },
        }
    }
}

impl ConsumerHandle {
    /// Stops consuming: lets the delivery in flight finish
    /// (committed and acknowledged, or rolled back), closes the channel and
    /// the connection — deliveries buffered but not started, or held for a
    /// retry, go back to the queue — and waits until all that is done.
    pub async fn shutdown(&self) {
        self.shutdown.send_replace(true);
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for task in tasks {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "consumer task ended abnormally");
            }
        }
        let purger = self.purger.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(purger) = purger {
            if let Err(e) = purger.await {
                tracing::error!(error = %e, "inbox purge task ended abnormally");
            }
        }
        for q in &self.queues {
            q.running.store(false, Ordering::SeqCst);
            q.connected.store(false, Ordering::SeqCst);
        }
    }

    /// Whether the consumer still runs.
    pub fn is_running(&self) -> bool {
        self.queues.iter().any(|q| q.running.load(Ordering::SeqCst))
    }

    /// Whether it is connected and consuming right now: its queue, or —
    /// partitioned — every partition it owns (a standby partition is
    /// consumed only while no other process consumes it, see
    /// [`consuming`](Self::consuming)).
    pub fn is_connected(&self) -> bool {
        self.queues
            .iter()
            .filter(|q| !q.standby)
            .all(|q| q.connected.load(Ordering::SeqCst))
    }

    /// The queues this consumer is subscribed to right now, in partition
    /// order. A partition's single active consumer decides which subscriber
    /// gets deliveries; a standby subscription hands its partition back as
    /// soon as another consumer waits for it.
    pub fn consuming(&self) -> Vec<String> {
        self.queues
            .iter()
            .filter(|q| q.connected.load(Ordering::SeqCst))
            .map(|q| q.queue.clone())
            .collect()
    }

    /// The queue consumed, or the partitions' prefix.
    pub fn queue(&self) -> &str {
        &self.name
    }

    /// The consumer name recorded in the inbox.
    pub fn consumer_name(&self) -> &str {
        &self.consumer_name
    }

    /// Counts since start.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            handled: get(&c.handled),
            duplicates: get(&c.duplicates),
            retried: get(&c.retried),
            dead_lettered: get(&c.dead_lettered),
            invalid: get(&c.invalid),
            store_errors: get(&c.store_errors),
            deferred: get(&c.deferred),
            held_back: get(&c.held_back),
            reconnects: get(&c.reconnects),
            takeovers: get(&c.takeovers),
            handovers: get(&c.handovers),
        }
    }
}

impl Drop for ConsumerHandle {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}
