//! The application's writes during a server fault, on any server database:
//! transactions of 1–8 test messages, tried again when the database was out
//! of reach, and the batches whose `COMMIT` got no answer kept as uncertain
//! until the test looks ([`Enqueued::settle_with`]).

use std::collections::HashSet;
use std::future::Future;
use std::time::Duration;

use outbox_api::MessageId;

use crate::check::Expected;

/// What the application's writer wrote
/// ([`postgres::enqueue_many`](crate::postgres::enqueue_many),
/// [`mysql::enqueue_many`](crate::mysql::enqueue_many)): the messages whose
/// transaction committed, and the batches whose `COMMIT` failed with the
/// connection (committed or not: the backend's `settle` looks).
#[derive(Debug, Default)]
pub struct Enqueued {
    /// Committed for certain.
    pub committed: Vec<Expected>,
    /// Batches whose outcome is unknown.
    pub uncertain: Vec<Vec<Expected>>,
    /// Transactions that failed (and were rolled back or are uncertain)
    /// because the database was out of reach.
    pub interrupted: u64,
}

impl Enqueued {
    /// The messages that were enqueued, given which of the uncertain ones
    /// are in the outbox (`present`): the committed ones and each uncertain
    /// batch whose rows are all there (a batch is one transaction: all of
    /// its rows are there, or none — anything else is an error), in
    /// sequence order.
    pub fn settle_with(mut self, present: &HashSet<MessageId>) -> Result<Vec<Expected>, String> {
        for batch in self.uncertain.drain(..) {
            let there = batch.iter().filter(|e| present.contains(&e.id)).count();
            if there == batch.len() {
                self.committed.extend(batch);
            } else if there != 0 {
                return Err(format!(
                    "a transaction was half committed: {there} of {} rows are there",
                    batch.len()
                ));
            }
        }
        self.committed.sort_by_key(|e| e.seq);
        Ok(self.committed)
    }
}

/// Why one batch's transaction did not commit for certain.
pub(crate) enum BatchFailed {
    /// The database was out of reach before the `COMMIT`: rolled back.
    Unavailable,
    /// The `COMMIT` itself failed with the connection: these messages may
    /// or may not be there.
    Commit(Vec<Expected>),
    /// Anything else: the test fails with it.
    Other(String),
}

/// Enqueues `count` messages in transactions of 1–8 messages (sizes from
/// `rng`, as [`check::enqueue_many`](crate::check::enqueue_many) on SQLite);
/// about one in three has a key out of `keys` keys named
/// `{key_prefix}{n}`; sequence numbers start at `first_seq`. `batch`
/// writes one transaction. A batch rolled back because the database was
/// out of reach is written again after 50 ms; one whose `COMMIT` failed is
/// kept as uncertain; any other failure is returned.
pub(crate) async fn enqueue_many<F, Fut>(
    rng: &mut fastrand::Rng,
    first_seq: i64,
    count: usize,
    keys: usize,
    key_prefix: &str,
    mut batch: F,
) -> Result<Enqueued, String>
where
    F: FnMut(Vec<(i64, Option<String>)>) -> Fut,
    Fut: Future<Output = Result<Vec<Expected>, BatchFailed>>,
{
    let mut out = Enqueued::default();
    let mut seq = first_seq;
    let mut written = 0;
    while written < count {
        let n = rng.usize(1..=8).min(count - written);
        let messages: Vec<(i64, Option<String>)> = (0..n)
            .map(|i| {
                let key = (keys > 0 && rng.u8(..3) == 0)
                    .then(|| format!("{key_prefix}{}", rng.usize(..keys)));
                (seq + i as i64, key)
            })
            .collect();
        seq += n as i64;
        loop {
            match batch(messages.clone()).await {
                Ok(done) => out.committed.extend(done),
                Err(BatchFailed::Commit(uncertain)) => {
                    out.interrupted += 1;
                    out.uncertain.push(uncertain);
                }
                Err(BatchFailed::Unavailable) => {
                    // Rolled back: the same messages again, once the
                    // database answers.
                    out.interrupted += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(BatchFailed::Other(e)) => return Err(e),
            }
            break;
        }
        written += n;
    }
    Ok(out)
}
