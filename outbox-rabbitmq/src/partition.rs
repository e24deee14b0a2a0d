//! [`Partitions`]: a key-partitioned set of queues. The function that maps
//! an ordering key to its partition is [`outbox_api::partition`]'s, shared
//! with every other transport (used by the relay's transport to route and
//! by tests to check).
//!
//! The relay publishes a message for a partitioned exchange with routing
//! key `<routing key>.<partition>`, the partition being
//! [`Partitions::of_key`] of its ordering key (FNV-1a, 64 bit, of the
//! key's bytes, modulo the partition count: stable across processes,
//! platforms and versions) — or of its message id when it has no key, which
//! spreads keyless messages over the partitions. Each subscriber declares
//! `count` queues `<prefix>.<i>` bound with `<routing key>.<i>`
//! ([`Topology::partitioned`](crate::Topology::partitioned)), each with a
//! single active consumer, so a key's messages are consumed by one process
//! at a time, in order.

use outbox_api::{Error, MessageId, Result};

/// The most partitions a set may have.
pub use outbox_api::partition::MAX_PARTITIONS;

/// A set of `count` partition queues named `<prefix>.0` … `<prefix>.<count-1>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Partitions {
    prefix: String,
    count: u16,
}

impl Partitions {
    /// `count` partitions named after `prefix`. Fails (naming the field)
    /// when `count` is 0 or above [`MAX_PARTITIONS`], or `prefix` is empty.
    pub fn new(prefix: impl Into<String>, count: u16) -> Result<Self> {
        let prefix = prefix.into();
        if prefix.is_empty() {
            return Err(Error::config("partitions prefix", "must not be empty"));
        }
        check_count(count)?;
        Ok(Partitions { prefix, count })
    }

    /// The queue names' prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// How many partitions.
    pub fn count(&self) -> u16 {
        self.count
    }

    /// The queue of partition `i`: `<prefix>.<i>`.
    pub fn queue(&self, i: u16) -> String {
        format!("{}.{i}", self.prefix)
    }

    /// Every partition's queue, in partition order.
    pub fn queues(&self) -> Vec<String> {
        (0..self.count).map(|i| self.queue(i)).collect()
    }

    /// The partition of a message with ordering key `key` among `count`
    /// ([`outbox_api::partition::of_key`]).
    pub fn of_key(key: &str, count: u16) -> u16 {
        outbox_api::partition::of_key(key, count)
    }

    /// The partition of a message: by its key, or by its id when it has none
    /// ([`outbox_api::partition::of_message`]).
    pub fn of_message(key: Option<&str>, id: MessageId, count: u16) -> u16 {
        outbox_api::partition::of_message(key, id, count)
    }

    /// The routing key a message of partition `partition` is published
    /// with: `<routing_key>.<partition>`.
    pub fn routing_key(routing_key: &str, partition: u16) -> String {
        format!("{routing_key}.{partition}")
    }
}

pub(crate) fn check_count(count: u16) -> Result<()> {
    outbox_api::partition::check_count("partitions", count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_name_their_queues_and_route_keys_by_the_shared_hash() {
        assert_eq!(
            Partitions::of_key("order-1", 8),
            Partitions::of_key("order-1", 8)
        );
        let mut seen = [0u32; 8];
        for k in 0..800 {
            seen[usize::from(Partitions::of_key(&format!("key-{k}"), 8))] += 1;
        }
        assert!(seen.iter().all(|n| *n > 50), "{seen:?}");
        let p = Partitions::new("wh", 3).unwrap();
        assert_eq!(p.queues(), vec!["wh.0", "wh.1", "wh.2"]);
        assert_eq!(Partitions::routing_key("OrderPlaced", 2), "OrderPlaced.2");
    }

    #[test]
    fn bad_partitions_are_refused_naming_the_field() {
        let e = Partitions::new("wh", 0).unwrap_err();
        assert!(e.to_string().contains("partitions"), "{e}");
        let e = Partitions::new("wh", MAX_PARTITIONS + 1).unwrap_err();
        assert!(e.to_string().contains("partitions"), "{e}");
        let e = Partitions::new("", 2).unwrap_err();
        assert!(e.to_string().contains("prefix"), "{e}");
    }
}
