//! Conformance of [`Transport`] implementations.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{Message, MessageId, Outcome, Transport};

/// A transport wired to something that records what arrives, with a way to
/// break and heal its connection.
#[async_trait]
pub trait TransportUnderTest: Send + Sync {
    /// The transport.
    fn transport(&self) -> Arc<dyn Transport>;
    /// A message that the transport can deliver (the `n`-th of a test).
    fn deliverable(&self, n: usize) -> Message;
    /// A message that the broker will refuse (e.g. unroutable).
    fn rejectable(&self) -> Message;
    /// Cuts the connection to the broker.
    async fn break_connection(&self);
    /// Restores it.
    async fn heal_connection(&self);
    /// Ids that reached the receiving side so far, in arrival order.
    async fn received(&self) -> Vec<MessageId>;
}

/// Expands to one `#[test]` per transport contract clause.
#[macro_export]
macro_rules! transport_conformance_tests {
    ($factory:expr) => {
        $crate::transport_conformance_tests!(@each $factory;
            delivers_batch_in_order, rejected_affects_only_that_message,
            unavailable_while_broken_then_recovers, empty_batch_is_fine,
            a_cancelled_send_leaves_it_usable);
    };
    (@each $factory:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::testing::block_on(async {
                    let sut = ($factory)().await;
                    $crate::testing::transport::$name(&sut).await;
                });
            }
        )*
    };
}

async fn wait_received(t: &dyn TransportUnderTest, expected: &[MessageId]) {
    let deadline = Duration::from_secs(20);
    let start = tokio::time::Instant::now();
    loop {
        let got = t.received().await;
        if expected.iter().all(|id| got.contains(id)) {
            return;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out waiting for {expected:?}; received {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One `Delivered` per message, and they arrive in the order given.
pub async fn delivers_batch_in_order(t: &dyn TransportUnderTest) {
    let batch: Vec<Message> = (0..20).map(|n| t.deliverable(n)).collect();
    let outcomes = t.transport().send(&batch).await;
    assert_eq!(outcomes, vec![Outcome::Delivered; 20]);
    let ids: Vec<MessageId> = batch.iter().map(|m| m.id).collect();
    wait_received(t, &ids).await;
    let got = t.received().await;
    let order: Vec<MessageId> = got.into_iter().filter(|id| ids.contains(id)).collect();
    assert_eq!(order, ids, "arrival order");
}

/// A refused message is `Rejected`; its neighbours are still delivered.
pub async fn rejected_affects_only_that_message(t: &dyn TransportUnderTest) {
    let batch = vec![t.deliverable(0), t.rejectable(), t.deliverable(1)];
    let outcomes = t.transport().send(&batch).await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert!(matches!(outcomes[1], Outcome::Rejected(_)), "{outcomes:?}");
    assert_eq!(outcomes[2], Outcome::Delivered);
    wait_received(t, &[batch[0].id, batch[2].id]).await;
}

/// With the connection cut, sends are `Unavailable` (never `Delivered` or
/// `Rejected`) and probing fails; once healed, probing succeeds and sends deliver.
pub async fn unavailable_while_broken_then_recovers(t: &dyn TransportUnderTest) {
    let warm = t.deliverable(0);
    assert_eq!(
        t.transport().send(std::slice::from_ref(&warm)).await,
        vec![Outcome::Delivered]
    );
    t.break_connection().await;
    let batch = vec![t.deliverable(1), t.deliverable(2)];
    let outcomes = t.transport().send(&batch).await;
    assert_eq!(outcomes.len(), 2);
    for o in &outcomes {
        assert!(
            matches!(o, Outcome::Unavailable(_)),
            "while broken: {outcomes:?}"
        );
    }
    assert!(t.transport().probe().await.is_err(), "probe while broken");
    t.heal_connection().await;
    let start = tokio::time::Instant::now();
    while let Err(e) = t.transport().probe().await {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never recovered: {e}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        t.transport().send(&batch).await,
        vec![Outcome::Delivered; 2]
    );
    wait_received(t, &[batch[0].id, batch[1].id]).await;
}

/// An empty batch returns no outcomes.
pub async fn empty_batch_is_fine(t: &dyn TransportUnderTest) {
    assert!(t.transport().send(&[]).await.is_empty());
}

/// The relay drops a send that outlives its `handler_timeout`. Dropped at
/// any point — before, during or after publishing — it leaves the transport
/// usable: the next send delivers, in order.
pub async fn a_cancelled_send_leaves_it_usable(t: &dyn TransportUnderTest) {
    let big: Vec<Message> = (0..200).map(|n| t.deliverable(n)).collect();
    for cut in [
        Duration::ZERO,
        Duration::from_micros(100),
        Duration::from_millis(1),
        Duration::from_millis(5),
    ] {
        let _ = tokio::time::timeout(cut, t.transport().send(&big)).await;
    }
    let next: Vec<Message> = (1000..1005).map(|n| t.deliverable(n)).collect();
    assert_eq!(
        t.transport().send(&next).await,
        vec![Outcome::Delivered; 5],
        "the first send after the cancelled ones"
    );
    let ids: Vec<MessageId> = next.iter().map(|m| m.id).collect();
    wait_received(t, &ids).await;
    let got = t.received().await;
    let order: Vec<MessageId> = got.into_iter().filter(|id| ids.contains(id)).collect();
    assert_eq!(order, ids, "arrival order");
}
