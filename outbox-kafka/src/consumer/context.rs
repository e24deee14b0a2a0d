//! The consumer's librdkafka callbacks: a revoked partition commits the
//! offset below its oldest unsettled message before it goes, and the
//! client's statistics say whether a broker connection is up.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use outbox_api::receive::{Counters, bump};
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::{Offset, Statistics, TopicPartitionList};

use super::offsets::{Offsets, Partition};
use crate::KafkaConfig;

/// What the callbacks share with the consume loop.
pub(super) struct Shared {
    pub(super) config: KafkaConfig,
    pub(super) group: String,
    pub(super) offsets: Mutex<Offsets>,
    /// Raised by every rebalance: the loop drops what it holds of
    /// partitions it no longer has before it runs anything else.
    pub(super) epoch: AtomicU64,
    /// The partitions assigned now.
    pub(super) assigned: Mutex<BTreeSet<Partition>>,
    pub(super) connected: AtomicBool,
    /// Whether a broker connection was up once (a later "up" after a
    /// "down" is a reconnect).
    was_up: AtomicBool,
    pub(super) counters: Arc<Counters>,
}

impl Shared {
    pub(super) fn new(config: KafkaConfig, group: String, counters: Arc<Counters>) -> Self {
        Shared {
            config,
            group,
            offsets: Mutex::new(Offsets::default()),
            epoch: AtomicU64::new(0),
            assigned: Mutex::new(BTreeSet::new()),
            connected: AtomicBool::new(false),
            was_up: AtomicBool::new(false),
            counters,
        }
    }

    pub(super) fn offsets(&self) -> std::sync::MutexGuard<'_, Offsets> {
        self.offsets.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn assigned(&self) -> std::sync::MutexGuard<'_, BTreeSet<Partition>> {
        self.assigned.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The list librdkafka takes for a commit.
pub(super) fn commit_list(offsets: &[(Partition, i64)]) -> TopicPartitionList {
    let mut list = TopicPartitionList::with_capacity(offsets.len());
    for ((topic, partition), offset) in offsets {
        // Only fails for an invalid offset; these are all ≥ 0.
        let _ = list.add_partition_offset(topic, *partition, Offset::Offset(*offset));
    }
    list
}

fn partitions_of(list: &TopicPartitionList) -> Vec<Partition> {
    list.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

/// The consumer's [`ConsumerContext`].
pub(super) struct Context(pub(super) Arc<Shared>);

impl ClientContext for Context {
    fn stats(&self, statistics: Statistics) {
        let up = statistics
            .brokers
            .values()
            .any(|b| b.nodeid >= 0 && b.state == "UP");
        let shared = &self.0;
        let was = shared.connected.swap(up, Ordering::SeqCst);
        if up && !was {
            if shared.was_up.swap(true, Ordering::SeqCst) {
                bump(&shared.counters.reconnects);
                tracing::info!(group = %shared.group, "Kafka connection restored");
            }
        } else if !up && was {
            tracing::warn!(group = %shared.group, "no Kafka broker connection is up");
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let shared = &self.0;
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown) {
            shared.connected.store(false, Ordering::SeqCst);
        }
        tracing::warn!(
            group = %shared.group,
            error = %shared.config.scrub(&error.to_string()),
            reason = %shared.config.scrub(reason),
            "Kafka consumer error"
        );
    }
}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let shared = &self.0;
        match rebalance {
            Rebalance::Revoke(list) => {
                let partitions = partitions_of(list);
                let commits = shared.offsets().revoke(&partitions);
                shared.epoch.fetch_add(1, Ordering::SeqCst);
                shared.assigned().retain(|p| !partitions.contains(p));
                if !commits.is_empty()
                    && let Err(e) = consumer.commit(&commit_list(&commits), CommitMode::Sync)
                {
                    // Its next owner reads from the offset committed before:
                    // more duplicates for the inbox, nothing lost.
                    tracing::warn!(group = %shared.group, error = %e,
                        "committing the offsets of revoked partitions failed");
                }
                tracing::info!(group = %shared.group, revoked = ?partitions, committed = ?commits,
                    "Kafka partitions revoked");
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => {
                tracing::warn!(group = %shared.group, error = %e, "Kafka rebalance failed");
            }
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let shared = &self.0;
            let partitions = partitions_of(list);
            shared.epoch.fetch_add(1, Ordering::SeqCst);
            shared.assigned().extend(partitions.iter().cloned());
            tracing::info!(group = %shared.group, assigned = ?partitions, "Kafka partitions assigned");
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(e) = result {
            // A later commit carries the same offsets or higher ones.
            tracing::debug!(group = %self.0.group, error = %e, "a Kafka offset commit failed");
        }
    }
}
