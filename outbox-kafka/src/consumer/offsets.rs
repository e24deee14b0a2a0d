//! Which offset of each partition may be committed: everything below the
//! oldest message received and not settled yet (handled and committed to
//! the inbox, found a duplicate, or dead-lettered).
//!
//! Messages of one partition settle out of order (a key held for its retry
//! while other keys go on), so the committed offset stops at the oldest
//! unsettled one: after a crash or a rebalance the partition is read again
//! from there, and the inbox turns what was settled past it into
//! duplicates.

use std::collections::{BTreeMap, BTreeSet};

/// A partition: its topic and number.
pub(crate) type Partition = (String, i32);

#[derive(Debug, Default)]
struct Progress {
    /// Offsets received and not settled.
    unsettled: BTreeSet<i64>,
    /// One past the highest offset received.
    next: i64,
    /// The offset last handed out to commit, if any.
    committed: Option<i64>,
}

impl Progress {
    /// The offset to commit: the oldest unsettled, else one past the last.
    fn safe(&self) -> i64 {
        self.unsettled.first().copied().unwrap_or(self.next)
    }
}

/// The progress of every partition this consumer holds now.
#[derive(Debug, Default)]
pub(crate) struct Offsets {
    partitions: BTreeMap<Partition, Progress>,
}

impl Offsets {
    /// `offset` of `partition` was received.
    pub(crate) fn received(&mut self, partition: &Partition, offset: i64) {
        let p = match self.partitions.get_mut(partition) {
            Some(p) => p,
            None => self.partitions.entry(partition.clone()).or_default(),
        };
        p.unsettled.insert(offset);
        p.next = p.next.max(offset + 1);
    }

    /// `offset` of `partition` was settled. `false` when this consumer no
    /// longer holds the partition (it was revoked meanwhile).
    pub(crate) fn settled(&mut self, partition: &Partition, offset: i64) -> bool {
        match self.partitions.get_mut(partition) {
            Some(p) => p.unsettled.remove(&offset),
            None => false,
        }
    }

    /// Messages received and not settled, over every partition.
    pub(crate) fn unsettled(&self) -> usize {
        self.partitions.values().map(|p| p.unsettled.len()).sum()
    }

    /// The offsets to commit that moved since the last call: each
    /// partition's oldest unsettled offset (or one past its last). Marks
    /// them handed out.
    pub(crate) fn take_moved(&mut self) -> Vec<(Partition, i64)> {
        let mut out = Vec::new();
        for (partition, p) in &mut self.partitions {
            let safe = p.safe();
            if p.next > 0 && p.committed != Some(safe) {
                p.committed = Some(safe);
                out.push((partition.clone(), safe));
            }
        }
        out
    }

    /// Forgets `partitions` (revoked), returning the offset to commit for
    /// each one that received something: its oldest unsettled offset, so
    /// that its next owner reads on from there.
    pub(crate) fn revoke(&mut self, partitions: &[Partition]) -> Vec<(Partition, i64)> {
        partitions
            .iter()
            .filter_map(|partition| {
                let p = self.partitions.remove(partition)?;
                (p.next > 0).then(|| (partition.clone(), p.safe()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(n: i32) -> Partition {
        ("t".to_owned(), n)
    }

    #[test]
    fn the_commit_stops_at_the_oldest_unsettled_offset() {
        let mut o = Offsets::default();
        assert!(
            o.take_moved().is_empty(),
            "nothing received, nothing to commit"
        );
        for offset in 10..15 {
            o.received(&p(0), offset);
        }
        o.received(&p(1), 0);
        // 11 is held for a retry; the others settle.
        for offset in [10, 12, 13, 14] {
            assert!(o.settled(&p(0), offset));
        }
        assert_eq!(o.unsettled(), 2);
        assert_eq!(o.take_moved(), vec![(p(0), 11), (p(1), 0)]);
        assert!(o.take_moved().is_empty(), "unchanged: not handed out again");
        assert!(o.settled(&p(0), 11));
        assert_eq!(o.take_moved(), vec![(p(0), 15)]);
        assert!(o.settled(&p(1), 0));
        assert_eq!(o.take_moved(), vec![(p(1), 1)]);
        assert_eq!(o.unsettled(), 0);
    }

    #[test]
    fn a_revoked_partition_commits_its_oldest_unsettled_and_is_forgotten() {
        let mut o = Offsets::default();
        for offset in 0..4 {
            o.received(&p(0), offset);
        }
        o.settled(&p(0), 0);
        o.settled(&p(0), 2);
        o.received(&p(1), 7);
        o.settled(&p(1), 7);
        assert_eq!(
            o.revoke(&[p(0), p(1), p(2)]),
            vec![(p(0), 1), (p(1), 8)],
            "a partition that received nothing commits nothing"
        );
        assert!(
            !o.settled(&p(0), 1),
            "settling a revoked partition's message is refused"
        );
        assert_eq!(o.unsettled(), 0);
        // Assigned again later, it starts afresh.
        o.received(&p(0), 1);
        assert_eq!(o.take_moved(), vec![(p(0), 1)]);
    }
}
