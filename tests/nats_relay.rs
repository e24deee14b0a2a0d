//! The relay's rules over NATS JetStream (the local server, or
//! `OUTBOX_NATS_URL`): a memory outbox, the relay, the NATS transport
//! through a TCP proxy that cuts the connection, and the test's own stream
//! read back directly. Fails (never skips) when no server answers.

use std::collections::HashMap;
use std::time::Duration;

use outbox::{MessageId, MessageKind, MessageState, NewMessage, OperatorStore, Relay, RetryPolicy};
use outbox_api::testing::{TcpProxy, wait_until};
use outbox_memory::MemoryStore;
use outbox_nats::testing::{TestStream, header, nats_url, server_addr, unique_name};
use outbox_nats::{KEY_HEADER, MSG_ID_HEADER, NatsTransport};

mod outage;
use outage::{DEADLINE, enqueue, through_an_outage, wait_processed};

/// `(message id, key)` of every message `stream` stored, in order.
async fn stored(stream: &TestStream) -> Vec<(MessageId, Option<String>)> {
    stream
        .stored()
        .await
        .iter()
        .map(|m| {
            let id = header(&m.headers, MSG_ID_HEADER).expect("an id");
            (
                id.parse().expect("a message id"),
                header(&m.headers, KEY_HEADER),
            )
        })
        .collect()
}

/// Every one of `ids` is processed with no attempt counted, and `stream`
/// stored each exactly once.
async fn assert_each_stored_once_and_uncounted(
    store: &MemoryStore,
    stream: &TestStream,
    ids: &[MessageId],
) -> Vec<(MessageId, Option<String>)> {
    for id in ids {
        let m = store.get(*id).await.unwrap().unwrap();
        assert_eq!((m.state, m.attempts), (MessageState::Processed, 0), "{m:?}");
    }
    let stored = stored(stream).await;
    let mut seen: HashMap<MessageId, usize> = HashMap::new();
    for (id, _) in &stored {
        *seen.entry(*id).or_default() += 1;
    }
    assert_eq!(seen.len(), ids.len(), "every message stored");
    assert!(
        seen.values().all(|&n| n == 1),
        "a message stored twice: Nats-Msg-Id should have dropped the copy"
    );
    stored
}

/// Through a cut connection every message arrives exactly once, each
/// key's messages in commit order, and the outage counts no attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_arrives_once_in_key_order_through_an_outage_with_no_attempt_counted() {
    let stream = TestStream::new("relay").await;
    let proxy = TcpProxy::start(server_addr(&nats_url())).await;
    let transport = NatsTransport::connect(
        NatsTransport::builder(format!("nats://{}", proxy.addr()))
            .ack_timeout(Duration::from_secs(1))
            .max_reconnect_delay(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let store = MemoryStore::new();
    let relay = Relay::builder(store.clone())
        .transport(transport)
        .batch_size(50)
        .poll_interval(Duration::from_millis(20))
        .probe_initial(Duration::from_millis(20))
        .probe_max(Duration::from_millis(200))
        .spawn()
        .unwrap();

    let message = |n: usize| {
        NewMessage::new(
            MessageKind::Integration,
            "OrderPlaced",
            format!("order {n}"),
        )
        .destination(stream.name.as_str(), "orders")
        .key(format!("k{}", n % 7))
    };
    let ids = through_an_outage(&store, &relay, message, |healed| {
        if healed { proxy.heal() } else { proxy.cut() }
    })
    .await;

    let stored = assert_each_stored_once_and_uncounted(&store, &stream, &ids).await;
    // Per key, stream order is commit (enqueue) order.
    let rank: HashMap<MessageId, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut last: HashMap<String, usize> = HashMap::new();
    for (id, key) in &stored {
        let key = key.clone().expect("keyed");
        let r = rank[id];
        if let Some(prev) = last.insert(key.clone(), r) {
            assert!(prev < r, "key {key}: message {r} stored after {prev}");
        }
    }
    relay.shutdown().await;
    stream.delete().await;
}

/// A subject no stream captures is that message's failure: counted,
/// retried, poisoned at `max_attempts`; the others flow and the transport
/// is never reported down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_without_a_stream_is_counted_and_poisoned_while_others_flow() {
    let stream = TestStream::new("relay").await;
    let transport = NatsTransport::connect(NatsTransport::builder(nats_url()))
        .await
        .unwrap();
    let store = MemoryStore::new();
    let relay = Relay::builder(store.clone())
        .transport(transport)
        .max_attempts(3)
        .poll_interval(Duration::from_millis(20))
        .retry_policy(RetryPolicy::Fixed(Duration::from_millis(30)))
        .spawn()
        .unwrap();
    let bad = enqueue(
        &store,
        vec![
            NewMessage::new(MessageKind::Integration, "OrderPlaced", "lost?")
                .destination(format!("{}-nostream", stream.name), "x"),
        ],
    )[0];
    let good = enqueue(
        &store,
        (0..20)
            .map(|n| {
                NewMessage::new(MessageKind::Integration, "OrderPlaced", format!("{n}"))
                    .destination(stream.name.as_str(), "orders")
            })
            .collect(),
    );
    wait_until("the message without a stream is poisoned", DEADLINE, || {
        let store = store.clone();
        async move { store.get(bad).await.unwrap().map(|m| m.state) == Some(MessageState::Poisoned) }
    })
    .await;
    let m = store.get(bad).await.unwrap().unwrap();
    assert_eq!(m.attempts, 3, "{m:?}");
    let error = m.last_error.unwrap_or_default();
    assert!(
        error.contains("no JetStream stream captures subject"),
        "{error}"
    );
    wait_processed("the good messages processed", &store, &good).await;
    assert_eq!(stream.ids().await.len(), 20);
    assert_eq!(relay.health().await.transport, outbox::TransportHealth::Up);
    relay.shutdown().await;
    stream.delete().await;
}

/// A server of the test's own (file storage) killed with SIGKILL mid-run
/// and restarted on the same store: every message is stored once, none
/// is counted as an attempt, and the relay reports the transport down,
/// then up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_restarted_mid_run_loses_nothing_and_counts_no_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = outbox_nats::testing::OwnNats::start(dir.path());
    let transport = NatsTransport::connect(
        NatsTransport::builder(server.url())
            .ack_timeout(Duration::from_secs(1))
            .max_reconnect_delay(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let name = unique_name("crash");
    transport
        .declare(&outbox_nats::StreamSpec::new(
            name.as_str(),
            [format!("{name}.>")],
        ))
        .await
        .unwrap();
    let store = MemoryStore::new();
    let relay = Relay::builder(store.clone())
        .transport(transport.clone())
        .batch_size(50)
        .poll_interval(Duration::from_millis(20))
        .probe_initial(Duration::from_millis(20))
        .probe_max(Duration::from_millis(200))
        .spawn()
        .unwrap();
    let message = |n: usize| {
        NewMessage::new(
            MessageKind::Integration,
            "OrderPlaced",
            format!("order {n}"),
        )
        .destination(name.as_str(), "orders")
        .key(format!("k{}", n % 5))
    };
    let ids = through_an_outage(&store, &relay, message, |healed| {
        if healed {
            server.restart()
        } else {
            server.kill()
        }
    })
    .await;
    let stream = TestStream {
        name: name.clone(),
        js: transport.jetstream().clone(),
    };
    assert_each_stored_once_and_uncounted(&store, &stream, &ids).await;
    relay.shutdown().await;
}
