//! [`ConsumerHandle`]: a running consumer, its stats and its stop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use outbox_api::receive::{ConsumerStats, Counters};
use tokio::sync::watch;

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
        self.counters.stats()
    }
}

impl Drop for ConsumerHandle {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}
