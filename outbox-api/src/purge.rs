//! Deleting old rows in small batches without starving the application's
//! writers: shared by the relay's retention purge and the inbox purges.

use std::future::Future;
use std::time::Duration;

use crate::Result;

/// How long to rest after a purge statement that took `took`: four times as
/// long, at least 1 ms — so at most a fifth of the time goes to purging.
pub fn rest_after(took: Duration) -> Duration {
    (took * 4).max(Duration::from_millis(1))
}

/// Runs `step(limit)` — one statement deleting at most `limit` rows and
/// returning how many it deleted — until a statement deletes fewer than
/// `limit` or `stop()` says to stop; returns the total deleted.
///
/// Between statements it rests [`rest_after`] the last one's duration. On
/// SQLite a writer that finds the database locked sleeps in its busy
/// handler for growing intervals (1, 2, 5, 10 … ms); statements run back to
/// back would keep it out for the whole purge. The bench figure "enqueue tx
/// latency while the relay purges N processed rows in batches of B" (beside
/// the same writer with no purge, and one unbatched `DELETE`) shows what the
/// rests buy; see `docs/decisions.md#purge-in-resting-batches-in-its-own-task`.
pub async fn purge_in_batches<F, Fut>(
    limit: usize,
    mut stop: impl FnMut() -> bool,
    mut step: F,
) -> Result<u64>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<u64>>,
{
    let mut total = 0;
    loop {
        let started = tokio::time::Instant::now();
        let n = step(limit).await?;
        total += n;
        if (n as usize) < limit || stop() {
            return Ok(total);
        }
        tokio::time::sleep(rest_after(started.elapsed())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rests_four_times_the_statement_and_at_least_a_millisecond() {
        assert_eq!(rest_after(Duration::ZERO), Duration::from_millis(1));
        assert_eq!(
            rest_after(Duration::from_millis(3)),
            Duration::from_millis(12)
        );
    }

    #[test]
    fn runs_until_a_short_batch_or_stop() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut left = 23u64;
            let total = purge_in_batches(
                10,
                || false,
                |limit| {
                    let n = left.min(limit as u64);
                    left -= n;
                    async move { Ok(n) }
                },
            )
            .await
            .unwrap();
            assert_eq!((total, left), (23, 0));
            let mut calls = 0;
            let total = purge_in_batches(
                10,
                || true,
                |_| {
                    calls += 1;
                    async { Ok(10) }
                },
            )
            .await
            .unwrap();
            assert_eq!((total, calls), (10, 1), "stop is checked after each batch");
        });
    }
}
