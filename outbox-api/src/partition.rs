//! Key-hash partitions: the one function every transport and consumer uses
//! to map an ordering key to its partition, so that a sender and its
//! subscribers agree whatever broker carries the messages
//! ([decisions](../../docs/decisions.md), "Per-key order across consumer
//! processes").
//!
//! The partition of a message is FNV-1a (64 bit) of its ordering key's
//! bytes modulo the partition count — stable across processes, platforms
//! and versions — or of its message id when it has no key, which spreads
//! keyless messages over the partitions.

use crate::{Error, MessageId, Result};

/// The most partitions a set may have.
pub const MAX_PARTITIONS: u16 = 1024;

/// The partition of a message with ordering key `key` among `count`.
pub fn of_key(key: &str, count: u16) -> u16 {
    bucket(key.as_bytes(), count)
}

/// The partition of a message among `count`: by its key, or by its id when
/// it has none.
pub fn of_message(key: Option<&str>, id: MessageId, count: u16) -> u16 {
    match key {
        Some(key) => of_key(key, count),
        None => bucket(id.as_uuid().as_bytes(), count),
    }
}

/// Checks a partition count: 1 to [`MAX_PARTITIONS`]; the error names
/// `field`.
pub fn check_count(field: &str, count: u16) -> Result<()> {
    if count == 0 || count > MAX_PARTITIONS {
        return Err(Error::config(
            field,
            format!("must be 1 to {MAX_PARTITIONS} (got {count})"),
        ));
    }
    Ok(())
}

/// Checks a consumer's replica settings: `index` below `replicas` (at least
/// 1), and more than one replica only for a partitioned consumer
/// (`constructor` names how to make one, for the error).
pub fn check_replica(
    index: u16,
    replicas: u16,
    partitioned: bool,
    constructor: &str,
) -> Result<()> {
    if replicas == 0 || index >= replicas {
        return Err(Error::config(
            "replica",
            format!("needs index < replicas and replicas >= 1 (got {index} of {replicas})"),
        ));
    }
    if replicas > 1 && !partitioned {
        return Err(Error::config(
            "replica",
            format!("only partitioned consumers ({constructor}) have replicas"),
        ));
    }
    Ok(())
}

/// FNV-1a (64 bit) of `bytes`, modulo `count`.
fn bucket(bytes: &[u8], count: u16) -> u16 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % u64::from(count.max(1))) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_stable_and_spreads_keys() {
        // Fixed values: producers and consumers of any version must agree.
        assert_eq!(bucket(b"", 1000), (0xcbf2_9ce4_8422_2325u64 % 1000) as u16);
        assert_eq!(of_key("order-1", 1000), 325);
        assert_eq!(of_key("order-1", 8), of_key("order-1", 8));
        let mut seen = [0u32; 8];
        for k in 0..800 {
            seen[usize::from(of_key(&format!("key-{k}"), 8))] += 1;
        }
        assert!(seen.iter().all(|n| *n > 50), "{seen:?}");
        let id = MessageId::new();
        assert_eq!(of_message(Some("order-1"), id, 8), of_key("order-1", 8));
        assert!(of_message(None, id, 8) < 8);
    }

    #[test]
    fn bad_counts_are_refused_naming_the_field() {
        let e = check_count("partitions", 0).unwrap_err();
        assert!(e.to_string().contains("partitions"), "{e}");
        assert!(check_count("partitions", MAX_PARTITIONS + 1).is_err());
        assert!(check_count("partitions", MAX_PARTITIONS).is_ok());
    }
}
