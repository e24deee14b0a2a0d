//! What an outbox did over a recent window, minute by minute, from its own
//! rows: messages delivered, failed and poisoned, the backlog, and commit →
//! processed latency — what the console draws
//! ([`OperatorStore::activity`](crate::OperatorStore::activity)).
//!
//! A store answers with [`ActivityCounts`]: a few grouped counts over the
//! rows that can matter to the window — the pending and poisoned ones, and
//! the ones processed inside it (each of these sets has an index of its
//! own) — and [`Activity::from_counts`] turns them into series, the same
//! way for every store. Rows purged by retention before they could be
//! counted are not: a window longer than the retention shows less than
//! happened.
//!
//! * **Delivered** in a bucket: messages whose `processed_at` falls in it
//!   (operator discards included).
//! * **Failed**: messages whose *last* failed try (`failed_at`) falls in
//!   it, whatever became of them; several failures of one message in one
//!   minute count once. **Poisoned**: those of them poisoned by that try.
//! * **Backlog** at the end of a bucket: messages committed by then and
//!   neither processed nor poisoned by then.
//! * **Latency**: `processed_at − created_at` of the messages delivered in
//!   the bucket, as a histogram over [`LATENCY_BOUNDS_MS`]; a percentile is
//!   the upper bound of the class that holds it, as Prometheus'
//!   `histogram_quantile` reads a histogram.

use std::time::Duration;

use crate::{Error, MessageState, Result, Timestamp};

/// Upper bounds (milliseconds, inclusive) of the latency classes; one more
/// class holds everything longer.
pub const LATENCY_BOUNDS_MS: [i64; 16] = [
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 300_000,
];

/// The number of latency classes: one per bound, and one beyond the last.
pub const LATENCY_CLASSES: usize = LATENCY_BOUNDS_MS.len() + 1;

/// The most buckets a window may have.
pub const MAX_BUCKETS: usize = 1_440;

/// The window asked for: `[since, until)` in buckets of `bucket`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivityWindow {
    /// Start of the first bucket.
    pub since: Timestamp,
    /// End of the last bucket (usually now).
    pub until: Timestamp,
    /// Length of one bucket, at least one millisecond.
    pub bucket: Duration,
}

impl ActivityWindow {
    /// The `span` before `until` (`[until − span, until)`: a row stamped
    /// exactly `until` is after it), in buckets of `bucket`. Refused (an
    /// invalid-input error naming the problem) if the bucket is shorter
    /// than a millisecond, longer than the span, or the span holds more
    /// than [`MAX_BUCKETS`].
    pub fn last(span: Duration, bucket: Duration, until: Timestamp) -> Result<Self> {
        if bucket.as_millis() == 0 {
            return Err(Error::invalid_input(
                "activity bucket must be at least 1 ms long",
            ));
        }
        if bucket > span {
            return Err(Error::invalid_input(format!(
                "activity bucket ({bucket:?}) is longer than the window ({span:?})"
            )));
        }
        let w = ActivityWindow {
            since: Timestamp::from_millis(
                until
                    .as_millis()
                    .saturating_sub(i64::try_from(span.as_millis()).unwrap_or(i64::MAX)),
            ),
            until,
            bucket,
        };
        if w.buckets() > MAX_BUCKETS {
            return Err(Error::invalid_input(format!(
                "an activity window of {span:?} in buckets of {bucket:?} has {} buckets; at most {MAX_BUCKETS} are allowed",
                w.buckets()
            )));
        }
        Ok(w)
    }

    /// The bucket length in milliseconds (at least 1).
    pub fn bucket_ms(&self) -> i64 {
        i64::try_from(self.bucket.as_millis())
            .unwrap_or(i64::MAX)
            .max(1)
    }

    /// How many buckets the window has (the last may be shorter).
    pub fn buckets(&self) -> usize {
        let span = self
            .until
            .as_millis()
            .saturating_sub(self.since.as_millis())
            .max(0);
        usize::try_from((span + self.bucket_ms() - 1) / self.bucket_ms()).unwrap_or(usize::MAX)
    }

    /// The bucket of time `t`: `-1` before the window, else its index
    /// (which may be past the last bucket for times after `until`). SQL
    /// stores compute the same with [`bucket_sql`].
    pub fn bucket_of(&self, t: Timestamp) -> i64 {
        let d = t.as_millis() - self.since.as_millis();
        if d < 0 { -1 } else { d / self.bucket_ms() }
    }
}

/// The latency class of `millis` (`processed_at − created_at`).
pub fn latency_class(millis: i64) -> usize {
    LATENCY_BOUNDS_MS
        .iter()
        .position(|&b| millis <= b)
        .unwrap_or(LATENCY_BOUNDS_MS.len())
}

/// SQL (SQLite and PostgreSQL alike) for the latency class of the integer
/// expression `millis`, as [`latency_class`] computes it.
pub fn latency_class_sql(millis: &str) -> String {
    let mut sql = String::from("CASE");
    for (i, b) in LATENCY_BOUNDS_MS.iter().enumerate() {
        sql.push_str(&format!(" WHEN {millis} <= {b} THEN {i}"));
    }
    sql.push_str(&format!(" ELSE {} END", LATENCY_BOUNDS_MS.len()));
    sql
}

/// SQL for the bucket of the integer time expression `t`, as
/// [`ActivityWindow::bucket_of`] computes it, with the window's start and
/// bucket length as the SQL parameters `since` and `bucket` (e.g. `$1`,
/// `?1`).
pub fn bucket_sql(t: &str, since: &str, bucket: &str) -> String {
    format!("CASE WHEN {t} < {since} THEN -1 ELSE ({t} - {since}) / {bucket} END")
}

/// The rows an activity counts: pending or poisoned now, or processed
/// since the window's start (`$1`) — each set has an index of its own.
const COUNTED: &str =
    "(state IN ('pending', 'poisoned') OR (state = 'processed' AND processed_at >= $1))";

/// The queries of [`OperatorStore::activity_counts`](crate::OperatorStore::activity_counts)
/// for the outbox table `table` (quoted as the store needs), in SQL that
/// SQLite and PostgreSQL both read, with the window's start as `$1` and
/// its bucket length in milliseconds as `$2` (in SQLite `$1` and `$2` are
/// the first and second parameters too).
#[derive(Debug, Clone)]
pub struct ActivitySql {
    /// `(bucket, latency class, count)` of [`ActivityCounts::delivered`]
    /// (parameters `$1`, `$2`).
    pub delivered: String,
    /// `(bucket, state, count)` of [`ActivityCounts::failed`] (`$1`, `$2`).
    pub failed: String,
    /// `(bucket, count)` of [`ActivityCounts::created`] (`$1`, `$2`).
    /// ([`ActivityCounts::pending_now`] is the store's own count of its
    /// pending rows.)
    pub created: String,
}

impl ActivitySql {
    /// The queries over `table`.
    pub fn new(table: &str) -> Self {
        let bucket = |t: &str| bucket_sql(t, "$1", "$2");
        ActivitySql {
            delivered: format!(
                "SELECT {}, CAST({} AS BIGINT), count(*) FROM {table} \
                 WHERE state = 'processed' AND processed_at >= $1 GROUP BY 1, 2",
                bucket("processed_at"),
                latency_class_sql("(processed_at - created_at)")
            ),
            failed: format!(
                "SELECT {}, state, count(*) FROM {table} \
                 WHERE failed_at >= $1 AND {COUNTED} GROUP BY 1, 2",
                bucket("failed_at")
            ),
            created: format!(
                "SELECT {}, count(*) FROM {table} WHERE {COUNTED} GROUP BY 1",
                bucket("created_at")
            ),
        }
    }
}

/// What a store counts for a window ([`ActivityWindow`]), over its pending
/// and poisoned rows and the rows processed since the window's start.
/// Buckets are [`ActivityWindow::bucket_of`]'s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ActivityCounts {
    /// `(bucket of processed_at, latency class, messages)` of the rows
    /// processed in the window.
    pub delivered: Vec<(i64, usize, u64)>,
    /// `(bucket of failed_at, state now, messages)` of the rows above
    /// whose last failure is in the window.
    pub failed: Vec<(i64, MessageState, u64)>,
    /// `(bucket of created_at, messages)` of every row above (`-1`:
    /// committed before the window).
    pub created: Vec<(i64, u64)>,
    /// Messages pending now.
    pub pending_now: u64,
}

impl ActivityCounts {
    /// Counts with these parts (for stores outside this crate).
    pub fn new(
        delivered: Vec<(i64, usize, u64)>,
        failed: Vec<(i64, MessageState, u64)>,
        created: Vec<(i64, u64)>,
        pending_now: u64,
    ) -> Self {
        ActivityCounts {
            delivered,
            failed,
            created,
            pending_now,
        }
    }
}

/// One bucket of an [`Activity`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ActivityBucket {
    /// Start of the bucket.
    pub start: Timestamp,
    /// Messages delivered (processed) in it.
    pub delivered: u64,
    /// Messages whose last failed try was in it.
    pub failed: u64,
    /// Messages poisoned in it.
    pub poisoned: u64,
    /// Messages waiting at its end.
    pub backlog: u64,
    /// Messages delivered in it per latency class ([`LATENCY_BOUNDS_MS`]).
    pub latency: [u64; LATENCY_CLASSES],
}

impl ActivityBucket {
    /// The `q` quantile (0–1) of commit → processed in this bucket: the
    /// upper bound in milliseconds of the class that holds it (`None`
    /// without deliveries; `i64::MAX` beyond the last bound).
    pub fn latency_quantile(&self, q: f64) -> Option<i64> {
        let total: u64 = self.latency.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (class, n) in self.latency.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(LATENCY_BOUNDS_MS.get(class).copied().unwrap_or(i64::MAX));
            }
        }
        Some(i64::MAX)
    }
}

/// An outbox's activity over a window, bucket by bucket, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Activity {
    /// The window.
    pub window: ActivityWindow,
    /// One per bucket of the window.
    pub buckets: Vec<ActivityBucket>,
}

impl Activity {
    /// The series from a store's counts.
    pub fn from_counts(window: ActivityWindow, counts: &ActivityCounts) -> Self {
        let n = window.buckets();
        let mut buckets: Vec<ActivityBucket> = (0..n)
            .map(|i| ActivityBucket {
                start: Timestamp::from_millis(
                    window.since.as_millis() + i as i64 * window.bucket_ms(),
                ),
                delivered: 0,
                failed: 0,
                poisoned: 0,
                backlog: 0,
                latency: [0; LATENCY_CLASSES],
            })
            .collect();
        let slot = |b: i64| usize::try_from(b).ok().filter(|&i| i < n);
        // Finished (processed or poisoned) and committed after the end of
        // bucket i: what turns the backlog now into the backlog then.
        let mut finished_in = vec![0u64; n + 1];
        let mut created_in = vec![0u64; n + 1];
        let later = |b: i64| usize::try_from(b).ok().map(|i| i.min(n));
        for &(b, class, count) in &counts.delivered {
            if let Some(i) = slot(b) {
                buckets[i].delivered += count;
                buckets[i].latency[class.min(LATENCY_CLASSES - 1)] += count;
            }
            if let Some(i) = later(b) {
                finished_in[i] += count;
            }
        }
        for &(b, state, count) in &counts.failed {
            if let Some(i) = slot(b) {
                buckets[i].failed += count;
                if state == MessageState::Poisoned {
                    buckets[i].poisoned += count;
                }
            }
            if state == MessageState::Poisoned {
                if let Some(i) = later(b) {
                    finished_in[i] += count;
                }
            }
        }
        for &(b, count) in &counts.created {
            if let Some(i) = later(b) {
                created_in[i] += count;
            }
        }
        // Walking back from now: backlog(end of i) = backlog(end of i+1)
        // + finished in i+1 − committed in i+1; after the last bucket,
        // the backlog is the pending messages now.
        let mut backlog = counts.pending_now as i64 + finished_in[n] as i64 - created_in[n] as i64;
        for i in (0..n).rev() {
            buckets[i].backlog = backlog.max(0) as u64;
            backlog += finished_in[i] as i64 - created_in[i] as i64;
        }
        Activity { window, buckets }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window() -> ActivityWindow {
        ActivityWindow::last(
            Duration::from_secs(180),
            Duration::from_secs(60),
            Timestamp::from_millis(1_000_000),
        )
        .unwrap()
    }

    #[test]
    fn buckets_and_classes_agree_with_their_sql() {
        let w = window();
        assert_eq!(w.buckets(), 3);
        assert_eq!(w.bucket_of(Timestamp::from_millis(820_000 - 1)), -1);
        assert_eq!(w.bucket_of(Timestamp::from_millis(820_000)), 0);
        assert_eq!(w.bucket_of(Timestamp::from_millis(999_999)), 2);
        assert_eq!(latency_class(0), 0);
        assert_eq!(latency_class(1), 0);
        assert_eq!(latency_class(3), 2);
        assert_eq!(latency_class(10_000_000), LATENCY_BOUNDS_MS.len());
        assert!(latency_class_sql("d").starts_with("CASE WHEN d <= 1 THEN 0 WHEN d <= 2 THEN 1"));
        assert_eq!(
            bucket_sql("t", "$1", "$2"),
            "CASE WHEN t < $1 THEN -1 ELSE (t - $1) / $2 END"
        );
    }

    #[test]
    fn bad_windows_are_refused_naming_why() {
        let now = Timestamp::from_millis(0);
        let e = ActivityWindow::last(Duration::from_secs(60), Duration::ZERO, now).unwrap_err();
        assert!(e.to_string().contains("at least 1 ms"), "{e}");
        let e =
            ActivityWindow::last(Duration::from_secs(1), Duration::from_secs(2), now).unwrap_err();
        assert!(e.to_string().contains("longer than the window"), "{e}");
        let e = ActivityWindow::last(Duration::from_secs(3600), Duration::from_millis(1), now)
            .unwrap_err();
        assert!(e.to_string().contains("at most 1440"), "{e}");
    }

    /// Two messages committed before the window, one delivered in bucket 0
    /// and one poisoned in bucket 1; three committed in bucket 1, one of
    /// them delivered in bucket 2; two pending now.
    #[test]
    fn series_from_counts() {
        let counts = ActivityCounts::new(
            vec![(0, 2, 1), (2, 9, 1)],
            vec![
                (1, MessageState::Poisoned, 1),
                (1, MessageState::Pending, 1),
            ],
            vec![(-1, 2), (1, 3)],
            2,
        );
        let a = Activity::from_counts(window(), &counts);
        let got: Vec<(u64, u64, u64, u64)> = a
            .buckets
            .iter()
            .map(|b| (b.delivered, b.failed, b.poisoned, b.backlog))
            .collect();
        assert_eq!(got, vec![(1, 0, 0, 1), (0, 2, 1, 3), (1, 0, 0, 2)]);
        assert_eq!(a.buckets[0].latency_quantile(0.5), Some(5));
        assert_eq!(a.buckets[2].latency_quantile(0.99), Some(1_000));
        assert_eq!(a.buckets[1].latency_quantile(0.5), None);
        assert_eq!(a.buckets[1].start, Timestamp::from_millis(880_000));
    }
}
