use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use outbox_api::backend::{Wakeup, WakeupListener};
use outbox_api::{Error, Message, MessageId, Outcome, Result, Transport};

/// A transport that records what it delivered, with faults a test can
/// switch on through its [`MemoryTransportHandle`] (in the manner of
/// `tower_test::mock`).
#[derive(Debug, Clone)]
pub struct MemoryTransport {
    shared: Arc<Shared>,
}

/// Controls a [`MemoryTransport`] and reads what it delivered.
#[derive(Debug, Clone)]
pub struct MemoryTransportHandle {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    delivered_signal: Wakeup,
}

#[derive(Debug, Default)]
struct State {
    down: Option<String>,
    down_after: Option<usize>,
    reject_types: HashSet<String>,
    reject_ids: HashSet<MessageId>,
    delivered: Vec<Message>,
    probes: u64,
    sends: u64,
}

impl MemoryTransport {
    /// A working transport and the handle that controls it.
    pub fn new() -> (MemoryTransport, MemoryTransportHandle) {
        let shared = Arc::new(Shared::default());
        (
            MemoryTransport {
                shared: Arc::clone(&shared),
            },
            MemoryTransportHandle { shared },
        )
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.state.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemoryTransportHandle {
    /// Makes every send `Unavailable` (and probes fail) with `reason`.
    pub fn set_down(&self, reason: impl Into<String>) {
        lock(&self.shared).down = Some(reason.into());
    }

    /// Delivers `n` more messages, then goes down (an outage mid-batch).
    pub fn go_down_after(&self, n: usize) {
        lock(&self.shared).down_after = Some(n);
    }

    /// Brings the transport back up.
    pub fn set_up(&self) {
        let mut s = lock(&self.shared);
        s.down = None;
        s.down_after = None;
    }

    /// Whether it is down now.
    pub fn is_down(&self) -> bool {
        lock(&self.shared).down.is_some()
    }

    /// Rejects (as a broker nack would) every message of `message_type`.
    pub fn reject_type(&self, message_type: impl Into<String>) {
        lock(&self.shared).reject_types.insert(message_type.into());
    }

    /// Rejects one message.
    pub fn reject_id(&self, id: MessageId) {
        lock(&self.shared).reject_ids.insert(id);
    }

    /// Stops rejecting anything.
    pub fn accept_all(&self) {
        let mut s = lock(&self.shared);
        s.reject_types.clear();
        s.reject_ids.clear();
    }

    /// Every delivered message, in delivery order (duplicates included).
    pub fn delivered(&self) -> Vec<Message> {
        lock(&self.shared).delivered.clone()
    }

    /// Ids of delivered messages, in delivery order.
    pub fn delivered_ids(&self) -> Vec<MessageId> {
        lock(&self.shared).delivered.iter().map(|m| m.id).collect()
    }

    /// How many messages were delivered.
    pub fn delivered_count(&self) -> usize {
        lock(&self.shared).delivered.len()
    }

    /// How many times `probe` was called.
    pub fn probes(&self) -> u64 {
        lock(&self.shared).probes
    }

    /// How many times `send` was called.
    pub fn sends(&self) -> u64 {
        lock(&self.shared).sends
    }

    /// A listener woken after each batch that delivered something.
    pub fn on_delivery(&self) -> WakeupListener {
        self.shared.delivered_signal.listener()
    }
}

#[async_trait]
impl Transport for MemoryTransport {
    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut s = lock(&self.shared);
        s.sends += 1;
        let mut any = false;
        let outcomes = batch
            .iter()
            .map(|m| {
                if s.down_after == Some(0) {
                    s.down_after = None;
                    s.down = Some("connection lost (injected)".into());
                }
                if let Some(reason) = &s.down {
                    return Outcome::Unavailable(reason.clone());
                }
                if s.reject_types.contains(&m.message_type) || s.reject_ids.contains(&m.id) {
                    return Outcome::Rejected(format!(
                        "rejected by the broker (injected) for `{}`",
                        m.message_type
                    ));
                }
                if let Some(n) = s.down_after.as_mut() {
                    *n -= 1;
                }
                s.delivered.push(m.clone());
                any = true;
                Outcome::Delivered
            })
            .collect();
        drop(s);
        if any {
            self.shared.delivered_signal.notify();
        }
        outcomes
    }

    async fn probe(&self) -> Result<()> {
        let mut s = lock(&self.shared);
        s.probes += 1;
        match &s.down {
            Some(reason) => Err(Error::unavailable(reason.clone())),
            None => Ok(()),
        }
    }
}
