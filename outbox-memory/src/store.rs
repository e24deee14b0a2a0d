use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use outbox_api::activity::{ActivityCounts, ActivityWindow, latency_class};
use outbox_api::backend::Wakeup;
use outbox_api::{
    ClaimRequest, Clock, Enqueue, Error, ErrorKind, FailOutcome, Failure, ListQuery, Message,
    MessageId, MessageState, NewMessage, OperatorAction, OperatorStore, Release, Result, Stats,
    Store, SystemClock, Timestamp, WorkListener,
};

/// An outbox table (plus inbox) in memory, with transactions.
///
/// Cloning shares the same table. Messages enqueued in a
/// [`MemoryTransaction`] become visible, and wake listening relays, only
/// when it commits.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    inner: Mutex<Inner>,
    wakeup: Wakeup,
    clock: Arc<dyn Clock>,
}

#[derive(Default)]
struct Inner {
    next_seq: u64,
    rows: BTreeMap<u64, Message>,
    by_id: HashMap<MessageId, u64>,
    pending: BTreeSet<u64>,
    poisoned: BTreeSet<u64>,
    processed: BTreeSet<(Timestamp, u64)>,
    /// When each message last failed (what the SQL stores' `failed_at`
    /// column holds).
    failed_at: HashMap<u64, Timestamp>,
    inbox: HashMap<(String, MessageId), Timestamp>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("MemoryStore")
            .field("messages", &inner.rows.len())
            .field("pending", &inner.pending.len())
            .field("poisoned", &inner.poisoned.len())
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the wall clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// An empty store whose enqueue timestamps come from `clock` (give it the
    /// relay's clock in tests that move time).
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        MemoryStore {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner::default()),
                wakeup: Wakeup::new(),
                clock,
            }),
        }
    }

    /// Starts an application transaction.
    pub fn begin(&self) -> MemoryTransaction {
        MemoryTransaction {
            store: self.clone(),
            messages: Vec::new(),
            inbox: Vec::new(),
        }
    }

    /// Whether `consumer` has recorded `message_id` in its inbox (committed).
    pub fn inbox_contains(&self, consumer: &str, message_id: MessageId) -> bool {
        self.lock()
            .inbox
            .contains_key(&(consumer.to_owned(), message_id))
    }

    /// Deletes at most `limit` inbox entries received before `before`
    /// (oldest first); returns how many.
    pub(crate) fn purge_inbox(&self, before: Timestamp, limit: usize) -> u64 {
        let mut inner = self.lock();
        let mut old: Vec<(Timestamp, (String, MessageId))> = inner
            .inbox
            .iter()
            .filter(|(_, at)| **at < before)
            .map(|(pair, at)| (*at, pair.clone()))
            .collect();
        old.sort();
        old.truncate(limit);
        for (_, pair) in &old {
            inner.inbox.remove(pair);
        }
        old.len() as u64
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave `Inner` half-updated in
        // a way later calls would misread, so a poisoned lock is recovered.
        self.shared.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An application transaction on a [`MemoryStore`]: enqueue messages and
/// record inbox entries, then [`commit`](MemoryTransaction::commit).
/// Dropping it without committing rolls back.
pub struct MemoryTransaction {
    store: MemoryStore,
    messages: Vec<Message>,
    inbox: Vec<(String, MessageId)>,
}

impl std::fmt::Debug for MemoryTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTransaction")
            .field("messages", &self.messages.len())
            .field("inbox", &self.inbox.len())
            .finish()
    }
}

impl MemoryTransaction {
    /// Validates and adds `message`; visible once the transaction commits.
    pub fn enqueue(&mut self, message: NewMessage) -> Result<MessageId> {
        let message = message.into_message(self.store.shared.clock.now())?;
        let id = message.id;
        self.messages.push(message);
        Ok(id)
    }

    /// Records that `consumer` handles `message_id` in this transaction.
    /// Returns `false` when it was handled already (skip the work, still
    /// acknowledge). The entry is written at commit; if another transaction
    /// recorded the same pair first, that commit fails.
    pub fn try_receive(&mut self, consumer: &str, message_id: MessageId) -> bool {
        let pair = (consumer.to_owned(), message_id);
        if self.inbox.contains(&pair) || self.store.lock().inbox.contains_key(&pair) {
            return false;
        }
        self.inbox.push(pair);
        true
    }

    /// Commits: the messages become claimable and listening relays wake.
    pub fn commit(self) -> Result<()> {
        let now = self.store.shared.clock.now();
        let mut inner = self.store.lock();
        let mut ids = HashSet::new();
        for m in &self.messages {
            if inner.by_id.contains_key(&m.id) || !ids.insert(m.id) {
                return Err(Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "message id {} exists already; the transaction was rolled back",
                        m.id
                    ),
                ));
            }
        }
        for pair in &self.inbox {
            if inner.inbox.contains_key(pair) {
                return Err(Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "inbox: consumer `{}` already received message {}; the transaction was rolled back",
                        pair.0, pair.1
                    ),
                ));
            }
        }
        for pair in self.inbox {
            inner.inbox.insert(pair, now);
        }
        let wake = !self.messages.is_empty();
        for m in self.messages {
            let seq = inner.next_seq;
            inner.next_seq += 1;
            inner.by_id.insert(m.id, seq);
            inner.pending.insert(seq);
            inner.rows.insert(seq, m);
        }
        drop(inner);
        if wake {
            self.store.shared.wakeup.notify();
        }
        Ok(())
    }

    /// Discards everything (the same as dropping it).
    pub fn rollback(self) {}
}

#[async_trait]
impl Enqueue for MemoryTransaction {
    async fn enqueue(&mut self, message: NewMessage) -> Result<MessageId> {
        MemoryTransaction::enqueue(self, message)
    }
}

impl Inner {
    fn row_mut(&mut self, id: MessageId) -> Option<(u64, &mut Message)> {
        let seq = *self.by_id.get(&id)?;
        self.rows.get_mut(&seq).map(|m| (seq, m))
    }

    fn holds_lease(m: &Message, worker: &str) -> bool {
        m.state == MessageState::Pending && m.locked_by.as_deref() == Some(worker)
    }

    fn set_state(&mut self, seq: u64, state: MessageState, now: Timestamp) {
        let Some(m) = self.rows.get_mut(&seq) else {
            return;
        };
        match m.state {
            MessageState::Pending => self.pending.remove(&seq),
            MessageState::Poisoned => self.poisoned.remove(&seq),
            MessageState::Processed => self
                .processed
                .remove(&(m.processed_at.unwrap_or_default(), seq)),
        };
        m.state = state;
        m.locked_by = None;
        m.locked_until = None;
        match state {
            MessageState::Pending => {
                m.processed_at = None;
                self.pending.insert(seq);
            }
            MessageState::Poisoned => {
                self.poisoned.insert(seq);
            }
            MessageState::Processed => {
                m.processed_at = Some(now);
                self.processed.insert((now, seq));
            }
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Message>> {
        if request.limit == 0 {
            return Ok(Vec::new());
        }
        let now = request.now;
        let mut inner = self.lock();
        // A poisoned message parks the later messages of its key.
        let mut blocked: HashMap<String, u64> = HashMap::new();
        for seq in &inner.poisoned {
            if let Some(key) = &inner.rows[seq].key {
                blocked.entry(key.clone()).or_insert(*seq);
            }
        }
        let mut chosen = Vec::new();
        let mut blocked_now: HashSet<String> = HashSet::new();
        for &seq in &inner.pending {
            let m = &inner.rows[&seq];
            let key_blocked = m.key.as_ref().is_some_and(|k| {
                blocked_now.contains(k) || blocked.get(k).is_some_and(|p| *p < seq)
            });
            let claimable = !key_blocked
                && m.available_at <= now
                && m.locked_until.is_none_or(|until| until <= now)
                && request.kind.is_none_or(|k| k == m.kind);
            if claimable {
                chosen.push(seq);
                if chosen.len() == request.limit {
                    break;
                }
            } else if let Some(k) = &m.key {
                blocked_now.insert(k.clone());
            }
        }
        let until = now.saturating_add(request.lease);
        let mut out = Vec::with_capacity(chosen.len());
        for seq in chosen {
            let m = inner.rows.get_mut(&seq).expect("chosen row exists");
            m.locked_by = Some(request.worker.clone());
            m.locked_until = Some(until);
            out.push(m.clone());
        }
        Ok(out)
    }

    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> Result<()> {
        let mut inner = self.lock();
        for id in ids {
            if let Some(&seq) = inner.by_id.get(id) {
                if inner.rows[&seq].state == MessageState::Pending {
                    inner.set_state(seq, MessageState::Processed, now);
                }
            }
        }
        Ok(())
    }

    async fn fail(&self, f: &Failure) -> Result<FailOutcome> {
        let mut inner = self.lock();
        let Some((seq, m)) = inner.row_mut(f.id) else {
            return Ok(FailOutcome::LeaseLost);
        };
        if !Inner::holds_lease(m, &f.worker) {
            return Ok(FailOutcome::LeaseLost);
        }
        m.attempts += 1;
        m.last_error = Some(f.error.clone());
        let attempts = m.attempts;
        let outcome = if attempts >= f.max_attempts {
            inner.set_state(seq, MessageState::Poisoned, f.now);
            FailOutcome::Poisoned { attempts }
        } else {
            m.available_at = f.retry_at;
            m.locked_by = None;
            m.locked_until = None;
            FailOutcome::Retrying { attempts }
        };
        inner.failed_at.insert(seq, f.now);
        Ok(outcome)
    }

    async fn release(&self, r: &Release) -> Result<()> {
        let mut inner = self.lock();
        for id in &r.ids {
            if let Some((_, m)) = inner.row_mut(*id) {
                if Inner::holds_lease(m, &r.worker) {
                    m.locked_by = None;
                    m.locked_until = None;
                    m.available_at = r.available_at;
                    if let Some(e) = &r.error {
                        m.last_error = Some(e.clone());
                    }
                }
            }
        }
        Ok(())
    }

    async fn release_worker(&self, worker: &str) -> Result<u64> {
        let mut inner = self.lock();
        let held: Vec<u64> = inner
            .pending
            .iter()
            .copied()
            .filter(|seq| Inner::holds_lease(&inner.rows[seq], worker))
            .collect();
        for seq in &held {
            if let Some(m) = inner.rows.get_mut(seq) {
                m.locked_by = None;
                m.locked_until = None;
            }
        }
        Ok(held.len() as u64)
    }

    async fn stats(&self) -> Result<Stats> {
        let inner = self.lock();
        Ok(Stats::new(
            inner.pending.len() as u64,
            inner.poisoned.len() as u64,
            inner.processed.len() as u64,
            inner.pending.iter().map(|s| inner.rows[s].created_at).min(),
        ))
    }

    async fn purge_processed(&self, before: Timestamp, limit: usize) -> Result<u64> {
        let mut inner = self.lock();
        let victims: Vec<(Timestamp, u64)> = inner
            .processed
            .iter()
            .take_while(|(at, _)| *at < before)
            .take(limit)
            .copied()
            .collect();
        for entry in &victims {
            inner.processed.remove(entry);
            if let Some(m) = inner.rows.remove(&entry.1) {
                inner.by_id.remove(&m.id);
            }
            inner.failed_at.remove(&entry.1);
        }
        Ok(victims.len() as u64)
    }

    fn listen(&self) -> Box<dyn WorkListener> {
        Box::new(self.shared.wakeup.listener())
    }
}

#[async_trait]
impl OperatorStore for MemoryStore {
    async fn list(&self, q: &ListQuery) -> Result<Vec<Message>> {
        let inner = self.lock();
        let limit = if q.limit == 0 { 100 } else { q.limit };
        Ok(inner
            .rows
            .values()
            .filter(|m| q.state.is_none_or(|s| s == m.state))
            .filter(|m| q.message_type.as_ref().is_none_or(|t| *t == m.message_type))
            .filter(|m| {
                q.trace_id.as_deref().is_none_or(|t| {
                    m.trace_parent
                        .as_deref()
                        .and_then(outbox_api::trace::trace_id_of)
                        == Some(t)
                })
            })
            .skip(q.offset)
            .take(limit)
            .cloned()
            .collect())
    }

    async fn get(&self, id: MessageId) -> Result<Option<Message>> {
        let inner = self.lock();
        Ok(inner.by_id.get(&id).map(|seq| inner.rows[seq].clone()))
    }

    async fn retry(&self, id: MessageId, by: &str, now: Timestamp) -> Result<()> {
        let mut inner = self.lock();
        let action = OperatorAction::Retry;
        let (seq, m) = inner.row_mut(id).ok_or_else(|| not_found(id))?;
        action.check(id, m.state)?;
        m.attempts = 0;
        m.available_at = now;
        m.last_error = Some(action.audit_note(by, now, m.last_error.as_deref()));
        inner.set_state(seq, MessageState::Pending, now);
        drop(inner);
        self.shared.wakeup.notify();
        Ok(())
    }

    async fn discard(&self, id: MessageId, by: &str, now: Timestamp) -> Result<()> {
        let mut inner = self.lock();
        let action = OperatorAction::Discard;
        let (seq, m) = inner.row_mut(id).ok_or_else(|| not_found(id))?;
        action.check(id, m.state)?;
        m.last_error = Some(action.audit_note(by, now, m.last_error.as_deref()));
        inner.set_state(seq, MessageState::Processed, now);
        drop(inner);
        self.shared.wakeup.notify();
        Ok(())
    }

    async fn activity_counts(&self, window: &ActivityWindow) -> Result<ActivityCounts> {
        Ok(self.lock().activity_counts(window))
    }
}

impl Inner {
    /// [`OperatorStore::activity_counts`] over the rows pending or
    /// poisoned now and those processed since the window's start.
    fn activity_counts(&self, w: &ActivityWindow) -> ActivityCounts {
        let mut delivered: BTreeMap<(i64, usize), u64> = BTreeMap::new();
        let mut failed: HashMap<(i64, MessageState), u64> = HashMap::new();
        let mut created: BTreeMap<i64, u64> = BTreeMap::new();
        let processed = self.processed.range((w.since, 0)..).map(|&(_, seq)| seq);
        let seqs = self
            .pending
            .iter()
            .chain(&self.poisoned)
            .copied()
            .chain(processed);
        for seq in seqs {
            let m = &self.rows[&seq];
            *created.entry(w.bucket_of(m.created_at)).or_default() += 1;
            if let Some(at) = m
                .processed_at
                .filter(|_| m.state == MessageState::Processed)
            {
                let class = latency_class(at.as_millis() - m.created_at.as_millis());
                *delivered.entry((w.bucket_of(at), class)).or_default() += 1;
            }
            if let Some(&at) = self.failed_at.get(&seq).filter(|&&at| at >= w.since) {
                *failed.entry((w.bucket_of(at), m.state)).or_default() += 1;
            }
        }
        ActivityCounts::new(
            delivered.into_iter().map(|((b, c), n)| (b, c, n)).collect(),
            failed.into_iter().map(|((b, s), n)| (b, s, n)).collect(),
            created.into_iter().collect(),
            self.pending.len() as u64,
        )
    }
}

fn not_found(id: MessageId) -> Error {
    OperatorAction::not_found(id, "memory")
}
