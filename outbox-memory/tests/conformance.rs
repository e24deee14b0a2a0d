//! The memory backend runs the whole conformance suite.

use std::sync::Arc;

use async_trait::async_trait;
use outbox_api::testing::TransportUnderTest;
use outbox_api::{Message, MessageId, MessageKind, NewMessage, Timestamp, Transport};
use outbox_memory::{MemoryInbox, MemoryStore, MemoryTransport, MemoryTransportHandle};

async fn memory_store() -> MemoryStore {
    MemoryStore::new()
}

outbox_api::store_conformance_tests!(memory_store);

async fn memory_inbox() -> MemoryInbox {
    MemoryInbox::new(MemoryStore::new())
}

mod inbox {
    outbox_api::inbox_conformance_tests!(super::memory_inbox);
}

struct MemTransport(MemoryTransport, MemoryTransportHandle);

#[async_trait]
impl TransportUnderTest for MemTransport {
    fn transport(&self) -> Arc<dyn Transport> {
        Arc::new(self.0.clone())
    }
    fn deliverable(&self, n: usize) -> Message {
        NewMessage::new(MessageKind::Integration, "Ok", n.to_string().into_bytes())
            .into_message(Timestamp::now())
            .unwrap()
    }
    fn rejectable(&self) -> Message {
        NewMessage::new(MessageKind::Integration, "Unroutable", b"x".to_vec())
            .into_message(Timestamp::now())
            .unwrap()
    }
    async fn break_connection(&self) {
        self.1.set_down("connection cut by test");
    }
    async fn heal_connection(&self) {
        self.1.set_up();
    }
    async fn received(&self) -> Vec<MessageId> {
        self.1.delivered_ids()
    }
}

async fn memory_transport() -> MemTransport {
    let (t, h) = MemoryTransport::new();
    h.reject_type("Unroutable");
    MemTransport(t, h)
}

outbox_api::transport_conformance_tests!(memory_transport);

#[test]
fn inbox_turns_duplicates_into_one_effect() {
    let store = MemoryStore::new();
    let id = MessageId::new();
    let mut tx = store.begin();
    assert!(tx.try_receive("warehouse", id));
    assert!(
        !tx.try_receive("warehouse", id),
        "same transaction sees its own entry"
    );
    tx.commit().unwrap();
    let mut tx = store.begin();
    assert!(!tx.try_receive("warehouse", id), "already handled");
    assert!(
        tx.try_receive("billing", id),
        "another consumer is independent"
    );
    tx.commit().unwrap();
    assert!(store.inbox_contains("billing", id));

    // Two racing transactions: the second commit fails, so the effect happens once.
    let other = MessageId::new();
    let mut a = store.begin();
    let mut b = store.begin();
    assert!(a.try_receive("c", other));
    assert!(b.try_receive("c", other));
    a.commit().unwrap();
    let err = b.commit().unwrap_err();
    assert!(err.to_string().contains("already received"), "{err}");

    // A rolled-back receive leaves no entry.
    let third = MessageId::new();
    let mut tx = store.begin();
    assert!(tx.try_receive("c", third));
    drop(tx);
    assert!(!store.inbox_contains("c", third));
}
