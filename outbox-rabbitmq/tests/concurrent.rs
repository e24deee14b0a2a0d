//! Concurrent sends and fault isolation, against a real broker at
//! `OUTBOX_AMQP_URL`: several `send` calls in flight at once, and a message
//! the broker refuses by closing the channel among many good ones.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_api::testing::wait_until;
use outbox_api::{Message, MessageId, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_rabbitmq::RabbitTransport;
use outbox_rabbitmq::testing::{self, TcpProxy, amqp_url, broker_addr, unique_name, url_via};
use tokio::sync::Barrier;

/// Generous: the machine running the tests may be busy.
const PATIENCE: Duration = Duration::from_secs(30);

/// The test's own connection with a unique exchange and an exclusive queue
/// bound to it with routing key `deliver`, consumed into `received`.
struct Fixture {
    _connection: Connection,
    channel: Channel,
    exchange: String,
    queue: String,
    received: Arc<Mutex<Vec<MessageId>>>,
    extra_exchanges: Vec<String>,
}

impl Fixture {
    async fn new() -> Fixture {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("test connection to OUTBOX_AMQP_URL");
        let channel = connection.create_channel().await.expect("test channel");
        let exchange = unique_name("x");
        let queue = unique_name("q");
        testing::declare_bound_queue(&channel, &exchange, &queue, "deliver").await;
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "outbox-test".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume the test queue");
        let received: Arc<Mutex<Vec<MessageId>>> = Arc::default();
        let sink = Arc::clone(&received);
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                if let Some(id) = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|s| s.as_str().parse().ok())
                {
                    sink.lock().unwrap().push(id);
                }
            }
        });
        Fixture {
            _connection: connection,
            channel,
            exchange,
            queue,
            received,
            extra_exchanges: Vec::new(),
        }
    }

    fn deliverable(&self, n: usize) -> Message {
        NewMessage::new(
            MessageKind::Integration,
            "TestMessage",
            format!("payload {n}"),
        )
        .destination(self.exchange.as_str(), "deliver")
        .into_message(Timestamp::now())
        .expect("valid test message")
    }

    /// An exchange clients may not publish to: RabbitMQ answers a publish
    /// with ACCESS_REFUSED and closes the channel.
    async fn internal_exchange(&mut self) -> String {
        let name = unique_name("internal");
        self.channel
            .exchange_declare(
                name.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    internal: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare an internal exchange");
        self.extra_exchanges.push(name.clone());
        name
    }

    fn received(&self) -> Vec<MessageId> {
        self.received.lock().unwrap().clone()
    }

    /// Waits until every one of `ids` has arrived in the queue.
    async fn wait_received(&self, ids: &[MessageId]) {
        let what = format!("{} messages arrived in {}", ids.len(), self.queue);
        wait_until(&what, PATIENCE, || {
            let got = self.received();
            let ok = ids.iter().all(|id| got.contains(id));
            async move { ok }
        })
        .await;
    }

    async fn cleanup(self) {
        for name in self.extra_exchanges.iter().chain([&self.exchange]) {
            let _ = self
                .channel
                .exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self
            .channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

async fn transport() -> Arc<RabbitTransport> {
    Arc::new(
        RabbitTransport::builder(amqp_url())
            .confirm_timeout(Duration::from_secs(20))
            .build()
            .await
            .expect("connect to OUTBOX_AMQP_URL"),
    )
}

/// Sends `batch` as `calls` calls of consecutive messages, all started at
/// once from their own tasks; the outcomes in the order of `batch`.
async fn send_concurrently(
    transport: &Arc<RabbitTransport>,
    batch: &[Message],
    calls: usize,
) -> Vec<Outcome> {
    if batch.is_empty() {
        return Vec::new();
    }
    let size = batch.len().div_ceil(calls);
    let barrier = Arc::new(Barrier::new(batch.chunks(size).len()));
    let tasks: Vec<_> = batch
        .chunks(size)
        .map(|chunk| {
            let (transport, barrier, chunk) =
                (Arc::clone(transport), Arc::clone(&barrier), chunk.to_vec());
            tokio::spawn(async move {
                barrier.wait().await;
                let outcomes = transport.send(&chunk).await;
                assert_eq!(outcomes.len(), chunk.len(), "one outcome per message");
                outcomes
            })
        })
        .collect();
    let mut outcomes = Vec::with_capacity(batch.len());
    for task in tasks {
        outcomes.extend(task.await.expect("send task"));
    }
    outcomes
}

/// The position of each id's first arrival.
fn arrival_positions(received: &[MessageId]) -> HashMap<MessageId, usize> {
    let mut at = HashMap::new();
    for (n, id) in received.iter().enumerate() {
        at.entry(*id).or_insert(n);
    }
    at
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sends_are_all_delivered_each_in_its_order() {
    let fx = Fixture::new().await;
    let transport = transport().await;
    let (tasks, per_task, per_call) = (8, 50, 10);
    let calls: Vec<Vec<Message>> = (0..tasks * per_task / per_call)
        .map(|c| {
            (0..per_call)
                .map(|n| fx.deliverable(c * per_call + n))
                .collect()
        })
        .collect();
    let barrier = Arc::new(Barrier::new(tasks));
    let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most_in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let mine: Vec<Vec<Message>> = calls
                .iter()
                .skip(t * per_task / per_call)
                .take(per_task / per_call)
                .cloned()
                .collect();
            let (transport, barrier) = (Arc::clone(&transport), Arc::clone(&barrier));
            let (in_flight, most) = (Arc::clone(&in_flight), Arc::clone(&most_in_flight));
            tokio::spawn(async move {
                barrier.wait().await;
                for call in mine {
                    let now = in_flight.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    most.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                    let outcomes = transport.send(&call).await;
                    in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    assert_eq!(outcomes, vec![Outcome::Delivered; call.len()]);
                }
            })
        })
        .collect();
    for h in handles {
        h.await.expect("send task");
    }
    eprintln!(
        "{} messages in {} concurrent calls of {per_call} confirmed in {:?} (at most {} calls in flight)",
        tasks * per_task,
        calls.len(),
        start.elapsed(),
        most_in_flight.load(std::sync::atomic::Ordering::SeqCst)
    );
    let all: Vec<MessageId> = calls.iter().flatten().map(|m| m.id).collect();
    fx.wait_received(&all).await;
    let at = arrival_positions(&fx.received());
    for call in &calls {
        let positions: Vec<usize> = call.iter().map(|m| at[&m.id]).collect();
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]),
            "a call's messages arrived out of order: {positions:?}"
        );
    }
    assert_eq!(fx.received().len(), all.len(), "each message arrived once");
    fx.cleanup().await;
}

/// 200 good messages and, among them, one to an `internal` exchange: the
/// broker refuses that one (ACCESS_REFUSED) and closes the channel.
async fn refused_among_good_ones(calls: usize) {
    let mut fx = Fixture::new().await;
    let internal = fx.internal_exchange().await;
    let transport = transport().await;
    let mut batch: Vec<Message> = (0..200).map(|n| fx.deliverable(n)).collect();
    let bad = NewMessage::new(MessageKind::Integration, "TestMessage", "refused")
        .destination(internal.as_str(), "deliver")
        .into_message(Timestamp::now())
        .unwrap();
    batch.insert(117, bad.clone());

    let start = Instant::now();
    let outcomes = send_concurrently(&transport, &batch, calls).await;
    eprintln!("{calls} call(s): settled in {:?}", start.elapsed());
    for (m, o) in batch.iter().zip(&outcomes) {
        if m.id == bad.id {
            match o {
                Outcome::Rejected(why) => {
                    eprintln!("rejected: {why}");
                    assert!(why.contains("access refused"), "{why}");
                    assert!(why.contains(&internal), "{why}");
                }
                other => panic!("the refused message: {other:?}"),
            }
        } else {
            assert_eq!(*o, Outcome::Delivered, "{outcomes:?}");
        }
    }
    let good: Vec<MessageId> = batch
        .iter()
        .filter(|m| m.id != bad.id)
        .map(|m| m.id)
        .collect();
    fx.wait_received(&good).await;
    assert!(!fx.received().contains(&bad.id));

    // The transport still works, on the same connection.
    let next: Vec<Message> = (1000..1005).map(|n| fx.deliverable(n)).collect();
    assert_eq!(transport.send(&next).await, vec![Outcome::Delivered; 5]);
    transport.probe().await.expect("probe afterwards");
    let ids: Vec<MessageId> = next.iter().map(|m| m.id).collect();
    fx.wait_received(&ids).await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_exchange_rejects_only_its_message_in_one_call() {
    refused_among_good_ones(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_exchange_rejects_only_its_message_among_concurrent_calls() {
    refused_among_good_ones(8).await;
}

/// A refusal whose words name no exchange (a `CC` header that is not an
/// array): the suspects are sent one at a time and only the culprit is
/// rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unnamed_refusal_is_found_one_at_a_time() {
    let fx = Fixture::new().await;
    let transport = transport().await;
    let mut batch: Vec<Message> = (0..60).map(|n| fx.deliverable(n)).collect();
    let mut bad = fx.deliverable(999);
    bad.headers.insert("CC".into(), "not-an-array".into());
    batch.insert(31, bad.clone());

    let outcomes = send_concurrently(&transport, &batch, 4).await;
    for (m, o) in batch.iter().zip(&outcomes) {
        if m.id == bad.id {
            match o {
                Outcome::Rejected(why) => eprintln!("rejected: {why}"),
                other => panic!("the refused message: {other:?}"),
            }
        } else {
            assert_eq!(*o, Outcome::Delivered, "{outcomes:?}");
        }
    }
    let good: Vec<MessageId> = batch
        .iter()
        .filter(|m| m.id != bad.id)
        .map(|m| m.id)
        .collect();
    fx.wait_received(&good).await;
    assert_eq!(
        transport.send(&[fx.deliverable(1000)]).await,
        vec![Outcome::Delivered]
    );
    fx.cleanup().await;
}

/// lapin hands a returned message to whichever confirm completes next —
/// with concurrent calls, maybe another call's. Each unroutable message is
/// still `Rejected` in its own call and no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_messages_reach_their_own_call() {
    let fx = Fixture::new().await;
    let transport = transport().await;
    for round in 0..3 {
        let batch: Vec<Message> = (0..320)
            .map(|n| {
                let key = if n % 7 == 3 { "nowhere" } else { "deliver" };
                NewMessage::new(
                    MessageKind::Integration,
                    "TestMessage",
                    format!("{round}/{n}"),
                )
                .destination(fx.exchange.as_str(), key)
                .into_message(Timestamp::now())
                .unwrap()
            })
            .collect();
        let outcomes = send_concurrently(&transport, &batch, 8).await;
        for (n, o) in outcomes.iter().enumerate() {
            if n % 7 == 3 {
                assert!(
                    matches!(o, Outcome::Rejected(why) if why.contains("unroutable") && why.contains("nowhere")),
                    "message {n}: {o:?}"
                );
            } else {
                assert_eq!(*o, Outcome::Delivered, "message {n}");
            }
        }
    }
    fx.cleanup().await;
}

/// A lost connection is an outage, not a refusal: concurrent calls cut
/// mid-flight answer `Delivered` or `Unavailable`, never `Rejected`, and
/// once the connection heals the unavailable ones go out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_is_unavailable_for_every_concurrent_call() {
    let fx = Fixture::new().await;
    let url = amqp_url();
    let proxy = TcpProxy::start(broker_addr(&url).await).await;
    let transport = Arc::new(
        RabbitTransport::builder(url_via(&url, proxy.addr()))
            .confirm_timeout(Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(3))
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
            .build()
            .await
            .expect("connect through the proxy"),
    );
    let batch: Vec<Message> = (0..400).map(|n| fx.deliverable(n)).collect();
    let sending = {
        let (transport, batch) = (Arc::clone(&transport), batch.clone());
        tokio::spawn(async move { send_concurrently(&transport, &batch, 8).await })
    };
    // Cut once messages are flowing.
    wait_until("the first messages arrived", PATIENCE, || {
        let flowing = !fx.received().is_empty();
        async move { flowing }
    })
    .await;
    proxy.cut();
    let outcomes = sending.await.expect("send task");
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Delivered | Outcome::Unavailable(_))),
        "{outcomes:?}"
    );
    let unavailable = outcomes
        .iter()
        .filter(|o| **o != Outcome::Delivered)
        .count();
    eprintln!("{unavailable} of 400 unavailable after the cut");

    proxy.heal();
    wait_until("the transport is back", PATIENCE, || {
        let transport = Arc::clone(&transport);
        async move { transport.probe().await.is_ok() }
    })
    .await;
    let again: Vec<Message> = batch
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| **o != Outcome::Delivered)
        .map(|(m, _)| m.clone())
        .collect();
    let outcomes = send_concurrently(&transport, &again, 4).await;
    assert_eq!(outcomes, vec![Outcome::Delivered; again.len()]);
    let ids: Vec<MessageId> = batch.iter().map(|m| m.id).collect();
    fx.wait_received(&ids).await;
    fx.cleanup().await;
}
