//! [`CountingStore`]: records every error the relay gets from its store.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use outbox_api::{
    Backlog, ClaimRequest, FailOutcome, Failure, Message, MessageId, Release, Result, Stats, Store,
    Timestamp, WorkListener,
};

/// A [`Store`] that forwards to `inner` and records each error with the
/// call that returned it (`claim`, `complete`, ...), printing it to stderr
/// as a `STORE_ERROR <label> <call> [<kind>]: <error>` line. The fault tests assert that none happened — in
/// particular no `SQLITE_BUSY` ("database is locked").
#[derive(Debug, Clone)]
pub struct CountingStore<S> {
    inner: S,
    label: String,
    errors: Arc<Mutex<Vec<String>>>,
}

impl<S: Store> CountingStore<S> {
    /// Wraps `inner`; `label` (e.g. the worker id) prefixes each error.
    pub fn new(inner: S, label: impl Into<String>) -> Self {
        CountingStore {
            inner,
            label: label.into(),
            errors: Arc::default(),
        }
    }

    /// Every error so far, as `"<label> <call>: <error>"`.
    pub fn errors(&self) -> Vec<String> {
        self.errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn note<T>(&self, call: &str, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            let text = format!("STORE_ERROR {} {call} [{:?}]: {e}", self.label, e.kind());
            eprintln!("{text}");
            self.errors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(text);
        }
        r
    }
}

#[async_trait]
impl<S: Store> Store for CountingStore<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Message>> {
        self.note("claim", self.inner.claim(request).await)
    }

    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()> {
        self.note("complete", self.inner.complete(ids, now).await)
    }

    async fn fail(&self, failure: &Failure) -> Result<FailOutcome> {
        self.note("fail", self.inner.fail(failure).await)
    }

    async fn release_worker(&self, worker: &str) -> Result<u64> {
        self.note("release_worker", self.inner.release_worker(worker).await)
    }

    async fn release(&self, release: &Release) -> Result<()> {
        self.note("release", self.inner.release(release).await)
    }

    async fn complete_and_claim(
        &self,
        done: &[MessageId],
        now: Timestamp,
        next: &ClaimRequest,
    ) -> Result<Vec<Message>> {
        self.note(
            "complete_and_claim",
            self.inner.complete_and_claim(done, now, next).await,
        )
    }

    async fn stats(&self) -> Result<Stats> {
        self.note("stats", self.inner.stats().await)
    }

    async fn backlog(&self) -> Result<Backlog> {
        self.note("backlog", self.inner.backlog().await)
    }

    async fn purge_processed(&self, before: Timestamp, limit: usize) -> Result<u64> {
        self.note(
            "purge_processed",
            self.inner.purge_processed(before, limit).await,
        )
    }

    fn listen(&self) -> Box<dyn WorkListener> {
        self.inner.listen()
    }
}
