//! What the relay tests over a broker share: enqueueing into a memory
//! outbox, and a run through an outage of the broker.

use std::time::Duration;

use outbox::{MessageId, MessageState, NewMessage, OperatorStore, Store};
use outbox_api::testing::wait_until;
use outbox_memory::MemoryStore;

/// How long each wait of a run may take.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Enqueues `messages` in one transaction; their ids, in order.
pub fn enqueue(store: &MemoryStore, messages: Vec<NewMessage>) -> Vec<MessageId> {
    let mut tx = store.begin();
    let ids = messages
        .into_iter()
        .map(|m| tx.enqueue(m).unwrap())
        .collect();
    tx.commit().unwrap();
    ids
}

/// Enqueues 300 messages, takes the broker away (`up(false)`) once some
/// are delivered, enqueues 300 more, waits for the relay to report the
/// transport down, brings it back (`up(true)`), and waits until everything
/// is processed; returns the ids in enqueue order.
pub async fn through_an_outage(
    store: &MemoryStore,
    relay: &outbox::RelayHandle,
    message: impl Fn(usize) -> NewMessage,
    mut up: impl FnMut(bool),
) -> Vec<MessageId> {
    let mut ids = enqueue(store, (0..300).map(&message).collect());
    wait_until("some deliveries", DEADLINE, || {
        let store = store.clone();
        async move { store.stats().await.unwrap().pending < 300 }
    })
    .await;
    up(false);
    ids.extend(enqueue(store, (300..600).map(&message).collect()));
    wait_until("the relay to see the outage", DEADLINE, || {
        let relay = relay.relay().clone();
        async move {
            matches!(
                relay.health().await.transport,
                outbox::TransportHealth::Down(_)
            )
        }
    })
    .await;
    up(true);
    wait_until("every message processed", DEADLINE, || {
        let store = store.clone();
        async move { store.stats().await.unwrap().pending == 0 }
    })
    .await;
    ids
}

/// Waits (up to [`DEADLINE`], naming `what`) until every one of `ids` is
/// processed.
pub async fn wait_processed(what: &str, store: &MemoryStore, ids: &[MessageId]) {
    wait_until(what, DEADLINE, || {
        let store = store.clone();
        let ids = ids.to_vec();
        async move {
            for id in ids {
                if store.get(id).await.unwrap().map(|m| m.state) != Some(MessageState::Processed) {
                    return false;
                }
            }
            true
        }
    })
    .await;
}
