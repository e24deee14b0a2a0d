//! The inbox purge a consumer runs beside its deliveries.

use std::future::Future;
use std::time::Duration;

use crate::{Result, Timestamp};

/// Rows an inbox purge deletes per batch.
pub const INBOX_PURGE_BATCH: usize = 500;

/// Deletes inbox entries older than `retention` every `interval`, in
/// batches of [`INBOX_PURGE_BATCH`] that rest between them, until
/// `shutdown` turns true or its sender is gone. `purge(before, limit)` is
/// the inbox's [`purge`](crate::Inbox::purge); `table` names it in logs.
pub async fn purge_inbox_loop<F, Fut>(
    table: String,
    mut purge: F,
    retention: Duration,
    interval: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) where
    F: FnMut(Timestamp, usize) -> Fut,
    Fut: Future<Output = Result<u64>>,
{
    while !*shutdown.borrow() {
        let before = Timestamp::now().saturating_sub(retention);
        let stop = shutdown.clone();
        let purged = crate::backend::purge_in_batches(
            INBOX_PURGE_BATCH,
            || *stop.borrow(),
            |limit| purge(before, limit),
        )
        .await;
        match purged {
            Ok(0) => {}
            Ok(n) => tracing::info!(purged = n, %table, "purged inbox entries past retention"),
            Err(e) => tracing::warn!(error = %e, %table, "inbox purge failed; will retry"),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            // The handle is gone (dropped without shutdown): stop too.
            changed = shutdown.changed() => if changed.is_err() { return },
        }
    }
}
