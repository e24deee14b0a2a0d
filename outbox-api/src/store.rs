//! The relay's view of one outbox table.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::activity::{Activity, ActivityCounts, ActivityWindow};
use crate::error::{Error, Result};
use crate::message::{Message, MessageId, MessageKind, MessageState, Timestamp};

/// What a relay asks for when it claims work.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// The claiming relay's identity; stored as `locked_by`.
    pub worker: String,
    /// At most this many messages.
    pub limit: usize,
    /// The lease: claimed messages are `locked_until = now + lease`.
    pub lease: Duration,
    /// The current time, as the relay's clock says.
    pub now: Timestamp,
    /// `None` claims both kinds; `Some(kind)` only that kind (a relay without
    /// a transport, or whose transport is down, claims only domain messages).
    pub kind: Option<MessageKind>,
}

/// A counted failure of one delivery.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Failure {
    /// The relay that held the lease.
    pub worker: String,
    /// The message.
    pub id: MessageId,
    /// Why it failed; stored as `last_error`.
    pub error: String,
    /// When it may be claimed again (if it is not poisoned).
    pub retry_at: Timestamp,
    /// Poison when `attempts` reaches this.
    pub max_attempts: u32,
    /// The current time.
    pub now: Timestamp,
}

/// What became of a message after [`Store::fail`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOutcome {
    /// Back to pending, to be retried at `retry_at`; holds the new attempt count.
    Retrying {
        /// Attempts counted so far.
        attempts: u32,
    },
    /// Reached `max_attempts`: parked for a human.
    Poisoned {
        /// Attempts counted (= `max_attempts`).
        attempts: u32,
    },
    /// The worker no longer held the lease (it expired and another relay took
    /// the message, or it was already processed): nothing was changed.
    LeaseLost,
}

/// An uncounted release of leased messages (outage, shutdown).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Release {
    /// The relay that held the leases.
    pub worker: String,
    /// The messages; ids whose lease this worker no longer holds are skipped.
    pub ids: Vec<MessageId>,
    /// If set, stored as `last_error` (an outage); attempts never change.
    pub error: Option<String>,
    /// When they may be claimed again.
    pub available_at: Timestamp,
}

/// Counts over the outbox table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Stats {
    /// Messages waiting for delivery (including leased and delayed ones).
    pub pending: u64,
    /// Messages waiting for a human.
    pub poisoned: u64,
    /// Delivered messages not yet purged.
    pub processed: u64,
    /// `created_at` of the oldest pending message.
    pub oldest_pending_created_at: Option<Timestamp>,
}

/// What health needs to know about an outbox table: the work waiting and
/// how old it is — never the processed history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Backlog {
    /// Messages waiting for delivery (including leased and delayed ones).
    pub pending: u64,
    /// Messages waiting for a human.
    pub poisoned: u64,
    /// `created_at` of the oldest pending message.
    pub oldest_pending_created_at: Option<Timestamp>,
}

impl ClaimRequest {
    /// A claim of up to `limit` messages of either kind by `worker`, leased
    /// for `lease` from `now`.
    pub fn new(worker: impl Into<String>, limit: usize, lease: Duration, now: Timestamp) -> Self {
        ClaimRequest {
            worker: worker.into(),
            limit,
            lease,
            now,
            kind: None,
        }
    }

    /// Claims only messages of `kind` (`None`: both kinds).
    pub fn with_kind(mut self, kind: Option<MessageKind>) -> Self {
        self.kind = kind;
        self
    }
}

impl Failure {
    /// A counted failure of `id`, leased by `worker`, with `error`; retried
    /// at `retry_at` unless it reaches `max_attempts`.
    pub fn new(
        worker: impl Into<String>,
        id: MessageId,
        error: impl Into<String>,
        retry_at: Timestamp,
        max_attempts: u32,
        now: Timestamp,
    ) -> Self {
        Failure {
            worker: worker.into(),
            id,
            error: error.into(),
            retry_at,
            max_attempts,
            now,
        }
    }
}

impl Release {
    /// Gives `ids` leased by `worker` back, claimable again at `available_at`.
    pub fn new(worker: impl Into<String>, ids: Vec<MessageId>, available_at: Timestamp) -> Self {
        Release {
            worker: worker.into(),
            ids,
            error: None,
            available_at,
        }
    }

    /// Stores `error` as `last_error` (an outage); `None` leaves it.
    pub fn with_error(mut self, error: Option<String>) -> Self {
        self.error = error;
        self
    }
}

impl Stats {
    /// Counts by state and the oldest pending message's `created_at`.
    pub fn new(
        pending: u64,
        poisoned: u64,
        processed: u64,
        oldest_pending_created_at: Option<Timestamp>,
    ) -> Self {
        Stats {
            pending,
            poisoned,
            processed,
            oldest_pending_created_at,
        }
    }
}

impl Backlog {
    /// The pending and poisoned counts and the oldest pending `created_at`.
    pub fn new(pending: u64, poisoned: u64, oldest_pending_created_at: Option<Timestamp>) -> Self {
        Backlog {
            pending,
            poisoned,
            oldest_pending_created_at,
        }
    }
}

impl From<Stats> for Backlog {
    fn from(s: Stats) -> Self {
        Backlog {
            pending: s.pending,
            poisoned: s.poisoned,
            oldest_pending_created_at: s.oldest_pending_created_at,
        }
    }
}

/// The relay's view of one outbox table.
///
/// # Contract
/// Every backend passes the conformance suite in `outbox_api::testing`
/// (feature `testing`). In short:
///
/// * [`claim`](Store::claim) atomically leases up to `limit` *claimable*
///   messages, oldest (commit order) first, and returns them in that order.
///   A message is claimable when it is `Pending`, `available_at <= now`, its
///   lease is absent or expired (`locked_until <= now`), its kind matches the
///   request, and every earlier message with the same `key` is either
///   `Processed` or claimed in the same call. So a poisoned, delayed or
///   leased message parks only the later messages of its own key. Two
///   concurrent claims (in any processes) never return the same message
///   while its lease holds. Claiming does not count an attempt.
/// * [`complete`](Store::complete) marks messages `Processed` (idempotent;
///   the caller calls it only after delivery succeeded). It applies even if
///   the lease expired meanwhile: the message *was* delivered.
/// * [`fail`](Store::fail) counts one attempt, stores the error and either
///   reschedules at `retry_at` or poisons at `max_attempts`; it applies only
///   while `worker` holds the lease.
/// * [`release`](Store::release) gives leases back without counting an
///   attempt (outage, shutdown); [`release_worker`](Store::release_worker)
///   gives back all of one worker's leases (a restart).
/// * [`purge_processed`](Store::purge_processed) deletes at most `limit`
///   processed messages older than `before`, so that a caller can purge in
///   small batches without long write locks.
/// * Every method is safe to call concurrently.
#[async_trait]
pub trait Store: Send + Sync + Debug + 'static {
    /// Leases up to `request.limit` claimable messages; see the trait docs.
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Message>>;

    /// Marks messages processed at `now`.
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()>;

    /// Counts a failed attempt; see [`FailOutcome`].
    async fn fail(&self, failure: &Failure) -> Result<FailOutcome>;

    /// Releases leases without counting an attempt.
    async fn release(&self, release: &Release) -> Result<()>;

    /// Gives back, without counting an attempt, every lease `worker` holds
    /// on a pending message (available again at once, `available_at`
    /// unchanged); returns how many. A relay restarted with the same stable
    /// worker id calls it at start, so the work its previous process had
    /// claimed is not stuck until those leases expire.
    async fn release_worker(&self, worker: &str) -> Result<u64>;

    /// Marks `done` processed and then claims, exactly as
    /// [`complete`](Store::complete) followed by [`claim`](Store::claim)
    /// would (so the claim sees the completions: a completed message's key
    /// successors are claimable). The relay calls it between batches; a
    /// backend may do both in one round trip and one transaction. The
    /// default makes the two calls.
    async fn complete_and_claim(
        &self,
        done: &[MessageId],
        now: Timestamp,
        next: &ClaimRequest,
    ) -> Result<Vec<Message>> {
        self.complete(done, now).await?;
        self.claim(next).await
    }

    /// Counts by state and the age of the oldest pending message.
    async fn stats(&self) -> Result<Stats>;

    /// The pending and poisoned counts and the oldest pending message,
    /// equal to those of [`stats`](Store::stats). Health checks call it
    /// every few seconds, so it must cost in proportion to the backlog, not
    /// to the processed history (which a week's retention can make millions
    /// of rows). The default takes it from `stats`; a backend whose
    /// processed count is costly overrides it.
    async fn backlog(&self) -> Result<Backlog> {
        Ok(self.stats().await?.into())
    }

    /// Deletes at most `limit` processed messages with `processed_at < before`;
    /// returns how many it deleted.
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> Result<u64>;

    /// A listener that wakes when work may have arrived; see [`WorkListener`].
    /// The default never wakes early, so the relay falls back to polling.
    fn listen(&self) -> Box<dyn WorkListener> {
        Box::new(NeverWakes)
    }
}

/// Wakes a relay when new work may be claimable.
///
/// # Contract
/// [`wait`](WorkListener::wait) returns as soon as something changed since
/// the previous call returned (or since the listener was created) — an
/// in-process commit that enqueued must wake it at once; a backend may also
/// detect other processes' commits — and otherwise after `timeout`.
/// Spurious wake-ups are allowed; missed ones are not: a change that
/// happened while the caller was busy makes the next `wait` return at once.
/// `wait` is cancel-safe: the relay calls it inside `select!`, and a change
/// seen by a dropped `wait` future is reported by the next call.
#[async_trait]
pub trait WorkListener: Send + 'static {
    /// Waits for a change or `timeout`; returns whether a change was seen.
    async fn wait(&mut self, timeout: Duration) -> bool;
}

#[derive(Debug)]
struct NeverWakes;

#[async_trait]
impl WorkListener for NeverWakes {
    async fn wait(&mut self, timeout: Duration) -> bool {
        tokio::time::sleep(timeout).await;
        false
    }
}

/// An in-process "something was committed" signal, for backends to build
/// [`WorkListener`]s from. Cloning shares the signal.
#[derive(Debug, Clone)]
pub struct Wakeup {
    tx: Arc<watch::Sender<u64>>,
}

impl Default for Wakeup {
    fn default() -> Self {
        Wakeup {
            tx: Arc::new(watch::channel(0).0),
        }
    }
}

impl Wakeup {
    /// A new signal.
    pub fn new() -> Self {
        Self::default()
    }

    /// Announces a change to every listener.
    pub fn notify(&self) {
        self.tx.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// A listener that sees every later [`notify`](Wakeup::notify).
    pub fn listener(&self) -> WakeupListener {
        WakeupListener {
            rx: self.tx.subscribe(),
        }
    }
}

/// A [`WorkListener`] fed by a [`Wakeup`].
#[derive(Debug)]
pub struct WakeupListener {
    rx: watch::Receiver<u64>,
}

impl WakeupListener {
    /// Whether a notification arrived that was not yet seen; marks it seen.
    pub fn take_change(&mut self) -> bool {
        let changed = self.rx.has_changed().unwrap_or(false);
        if changed {
            self.rx.borrow_and_update();
        }
        changed
    }

    /// Waits for a notification (forever, if the signal is dropped).
    pub async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[async_trait]
impl WorkListener for WakeupListener {
    async fn wait(&mut self, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, self.changed()).await.is_ok()
    }
}

/// A query over messages, for operators.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ListQuery {
    /// Only messages in this state.
    pub state: Option<MessageState>,
    /// Only messages of this type.
    pub message_type: Option<String>,
    /// Only messages whose `trace_parent` carries this trace id (32
    /// lowercase hex digits, as [`trace::trace_id_of`](crate::trace::trace_id_of)
    /// reads it): one operation's messages, a saga.
    pub trace_id: Option<String>,
    /// At most this many (oldest first); `0` means the backend default (100).
    pub limit: usize,
    /// Skips this many matching messages first (paging: page `n` of size
    /// `s` is `offset(n * s).limit(s)`). Costs in proportion to the offset.
    pub offset: usize,
}

impl ListQuery {
    /// Every message, oldest first, up to the backend's default limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only messages in `state`.
    pub fn state(mut self, state: MessageState) -> Self {
        self.state = Some(state);
        self
    }

    /// Only messages of `message_type`.
    pub fn message_type(mut self, message_type: impl Into<String>) -> Self {
        self.message_type = Some(message_type.into());
        self
    }

    /// Only messages of the trace `trace_id` (32 lowercase hex digits).
    pub fn trace_id(mut self, trace_id: impl Into<String>) -> Self {
        self.trace_id = Some(trace_id.into());
        self
    }

    /// At most `limit` (`0`: the backend default).
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }

    /// Skips the first `offset` matching messages (oldest first).
    pub fn offset(mut self, offset: usize) -> Self {
        self.offset = offset;
        self
    }
}

/// Operator functions over an outbox table: inspect, retry and discard.
///
/// # Contract
/// * [`retry`](OperatorStore::retry) moves a `Poisoned` message back to
///   `Pending`, resets `attempts` to 0, makes it available at `now`, and
///   records who and when in `last_error`. Any other state is a
///   `Conflict` error; an unknown id is `NotFound`.
/// * [`discard`](OperatorStore::discard) marks a `Pending` or `Poisoned`
///   message `Processed` without delivering it, recording who and when in
///   `last_error`, so it unblocks its key and is purged by retention.
/// * [`activity_counts`](OperatorStore::activity_counts) counts, in the
///   window's buckets ([`ActivityWindow::bucket_of`]), over the rows pending
///   or poisoned now and the rows processed at or after `window.since`:
///   those processed in the window by bucket and latency class, those
///   whose last failure (the time [`Store::fail`] was given) is in the
///   window by bucket and state now, all of them by bucket of
///   `created_at`, and the pending ones now. It reads only; a table or
///   window it cannot count is an error, never an empty answer.
#[async_trait]
pub trait OperatorStore: Store {
    /// Messages matching `query`, oldest first.
    async fn list(&self, query: &ListQuery) -> Result<Vec<Message>>;

    /// One message.
    async fn get(&self, id: MessageId) -> Result<Option<Message>>;

    /// Poisoned → pending, attempts reset; `by` names the operator.
    async fn retry(&self, id: MessageId, by: &str, now: Timestamp) -> Result<()>;

    /// Pending or poisoned → processed without delivery; `by` names the operator.
    async fn discard(&self, id: MessageId, by: &str, now: Timestamp) -> Result<()>;

    /// What [`activity`](OperatorStore::activity) is drawn from (see the
    /// contract above and [`crate::activity`]).
    async fn activity_counts(&self, window: &ActivityWindow) -> Result<ActivityCounts>;

    /// Delivered, failed, poisoned, backlog and latency over `window`,
    /// bucket by bucket.
    async fn activity(&self, window: &ActivityWindow) -> Result<Activity> {
        let counts = self.activity_counts(window).await?;
        Ok(Activity::from_counts(*window, &counts))
    }
}

/// An operator's action on one message ([`OperatorStore::retry`],
/// [`OperatorStore::discard`]): the one place its precondition, its
/// refusal and its audit note are written, for every store and every
/// front end (CLI, console).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorAction {
    /// Poisoned → pending, attempts reset to 0, deliverable at once.
    Retry,
    /// Pending or poisoned → processed without delivery.
    Discard,
}

impl OperatorAction {
    /// `"retry"` or `"discard"`.
    pub fn name(self) -> &'static str {
        match self {
            OperatorAction::Retry => "retry",
            OperatorAction::Discard => "discard",
        }
    }

    /// `"retried"` or `"discarded"` (the audit note's verb).
    pub fn done(self) -> &'static str {
        match self {
            OperatorAction::Retry => "retried",
            OperatorAction::Discard => "discarded",
        }
    }

    /// `"retrying a message"` or `"discarding a message"`, for errors.
    pub fn doing(self) -> &'static str {
        match self {
            OperatorAction::Retry => "retrying a message",
            OperatorAction::Discard => "discarding a message",
        }
    }

    /// Whether the action applies to message `id` in `state`: a retry to
    /// a poisoned message only, a discard to any message not processed
    /// yet. The refusal is an [`ErrorKind::Conflict`](crate::ErrorKind)
    /// saying why; nothing is changed.
    pub fn check(self, id: MessageId, state: MessageState) -> Result<()> {
        let why = match (self, state) {
            (OperatorAction::Retry, MessageState::Poisoned) => return Ok(()),
            (OperatorAction::Retry, s) => {
                format!("message {id} is {s}, not poisoned; only poisoned messages can be retried")
            }
            (OperatorAction::Discard, MessageState::Processed) => {
                format!("message {id} is processed already; nothing to discard")
            }
            (OperatorAction::Discard, _) => return Ok(()),
        };
        Err(Error::new(crate::ErrorKind::Conflict, why))
    }

    /// The text the action leaves in `last_error`: who did it and when,
    /// with the error it replaces.
    pub fn audit_note(self, by: &str, now: Timestamp, previous: Option<&str>) -> String {
        audit_note(self.done(), by, now, previous)
    }

    /// The refusal for an id the outbox `table` does not hold.
    pub fn not_found(id: MessageId, table: &str) -> Error {
        Error::new(
            crate::ErrorKind::NotFound,
            format!("no message with id {id} in outbox table `{table}`"),
        )
    }

    /// Does it through `store`.
    pub async fn apply(
        self,
        store: &dyn OperatorStore,
        id: MessageId,
        by: &str,
        now: Timestamp,
    ) -> Result<()> {
        match self {
            OperatorAction::Retry => store.retry(id, by, now).await,
            OperatorAction::Discard => store.discard(id, by, now).await,
        }
    }
}

/// The text an operator action leaves in `last_error`.
pub fn audit_note(action: &str, by: &str, now: Timestamp, previous: Option<&str>) -> String {
    match previous {
        Some(prev) => format!("{action} by {by} at {now}; previous error: {prev}"),
        None => format!("{action} by {by} at {now}"),
    }
}

/// Where the relay gets the time from. Leases compare times written by
/// several processes, so production relays use the wall clock.
pub trait Clock: Send + Sync + Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that moves only when told to, for tests.
#[derive(Debug, Default)]
pub struct ManualClock {
    millis: std::sync::atomic::AtomicI64,
}

impl ManualClock {
    /// Starts at `start`.
    pub fn new(start: Timestamp) -> Self {
        ManualClock {
            millis: std::sync::atomic::AtomicI64::new(start.as_millis()),
        }
    }

    /// Moves forward by `d`.
    pub fn advance(&self, d: Duration) {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        self.millis
            .fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.millis.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// A clock that follows tokio's clock, so that tests with paused time
/// (`#[tokio::test(start_paused = true)]`) move leases and backoff too.
#[derive(Debug)]
pub struct TokioClock {
    start_wall: Timestamp,
    start: tokio::time::Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock {
            start_wall: Timestamp::now(),
            start: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        self.start_wall.saturating_add(self.start.elapsed())
    }
}
