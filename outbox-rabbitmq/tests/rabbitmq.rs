//! Tests against a real broker at `OUTBOX_AMQP_URL`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicRejectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_api::testing::TransportUnderTest;
use outbox_api::{
    ErrorKind, Message, MessageId, MessageKind, NewMessage, Outcome, Timestamp, Transport,
};
use outbox_rabbitmq::testing::{self, TcpProxy, amqp_url, percent_encode, unique_name};
use outbox_rabbitmq::{ExchangeType, RabbitConfig, RabbitTransport, Topology};

// ---------------------------------------------------------------- helpers

fn broker_url() -> String {
    amqp_url()
}

fn unique(prefix: &str) -> String {
    unique_name(prefix)
}

/// The broker URL with its host and port replaced.
fn url_via(addr: std::net::SocketAddr) -> String {
    testing::url_via(&broker_url(), addr)
}

async fn broker_addr() -> std::net::SocketAddr {
    testing::broker_addr(&broker_url()).await
}

fn message(n: usize) -> NewMessage {
    NewMessage::new(
        MessageKind::Integration,
        "TestMessage",
        format!("payload {n}"),
    )
}

fn stored(m: NewMessage) -> Message {
    m.into_message(Timestamp::now())
        .expect("valid test message")
}

/// The test's own connection (direct to the broker) with a unique
/// exchange and an exclusive queue bound to it with routing key `deliver`.
struct Fixture {
    _connection: Connection,
    channel: Channel,
    exchange: String,
    queue: String,
    received: Arc<Mutex<Vec<Message2>>>,
    extra_exchanges: Mutex<Vec<String>>,
}

/// What a consumer saw.
#[derive(Debug, Clone)]
struct Message2 {
    id: Option<String>,
}

impl Fixture {
    async fn new() -> Fixture {
        let connection = Connection::connect(&broker_url(), ConnectionProperties::default())
            .await
            .expect("test connection to OUTBOX_AMQP_URL");
        let channel = connection.create_channel().await.expect("test channel");
        let exchange = unique("x");
        let queue = unique("q");
        testing::declare_bound_queue(&channel, &exchange, &queue, "deliver").await;
        Fixture {
            _connection: connection,
            channel,
            exchange,
            queue,
            received: Arc::default(),
            extra_exchanges: Mutex::default(),
        }
    }

    /// Starts a consumer recording the message ids that arrive.
    async fn consume(&self) {
        let mut consumer = self
            .channel
            .basic_consume(
                self.queue.as_str().into(),
                "outbox-test".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume the test queue");
        let received = Arc::clone(&self.received);
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.as_str().to_owned());
                received.lock().unwrap().push(Message2 { id });
            }
        });
    }

    fn received_ids(&self) -> Vec<MessageId> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .filter_map(|m| m.id.as_deref()?.parse().ok())
            .collect()
    }

    fn deliverable(&self, n: usize) -> Message {
        stored(message(n).destination(self.exchange.as_str(), "deliver"))
    }

    fn unroutable(&self) -> Message {
        stored(message(999).destination(self.exchange.as_str(), "nowhere"))
    }

    async fn extra_exchange(&self) -> String {
        let name = unique("x2");
        self.channel
            .exchange_declare(
                name.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("declare extra exchange");
        self.extra_exchanges.lock().unwrap().push(name.clone());
        name
    }

    async fn get(&self) -> lapin::message::BasicGetMessage {
        for _ in 0..500 {
            if let Some(m) = self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get")
            {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no message arrived in {}", self.queue);
    }

    async fn cleanup(self) {
        let extra = std::mem::take(&mut *self.extra_exchanges.lock().unwrap());
        for name in extra.into_iter().chain([self.exchange.clone()]) {
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

async fn transport_direct() -> RabbitTransport {
    RabbitTransport::builder(broker_url())
        .confirm_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("connect to OUTBOX_AMQP_URL")
}

// ------------------------------------------------------------ conformance

struct UnderTest {
    fixture: Fixture,
    proxy: TcpProxy,
    transport: Arc<RabbitTransport>,
}

async fn under_test() -> UnderTest {
    let fixture = Fixture::new().await;
    fixture.consume().await;
    let proxy = TcpProxy::start(broker_addr().await).await;
    let transport = RabbitTransport::builder(url_via(proxy.addr()))
        .confirm_timeout(Duration::from_secs(3))
        .connect_timeout(Duration::from_secs(3))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
        .build()
        .await
        .expect("connect through the proxy");
    UnderTest {
        fixture,
        proxy,
        transport: Arc::new(transport),
    }
}

#[async_trait::async_trait]
impl TransportUnderTest for UnderTest {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }
    fn deliverable(&self, n: usize) -> Message {
        self.fixture.deliverable(n)
    }
    fn rejectable(&self) -> Message {
        self.fixture.unroutable()
    }
    async fn break_connection(&self) {
        self.proxy.cut();
    }
    async fn heal_connection(&self) {
        self.proxy.heal();
    }
    async fn received(&self) -> Vec<MessageId> {
        self.fixture.received_ids()
    }
}

mod conformance {
    use super::*;
    outbox_api::transport_conformance_tests!(under_test);
}

#[tokio::test]
async fn no_confirm_within_the_timeout_is_unavailable_then_recovers() {
    let fx = Fixture::new().await;
    fx.consume().await;
    let proxy = TcpProxy::start(broker_addr().await).await;
    let transport = RabbitTransport::builder(url_via(proxy.addr()))
        .confirm_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(100))
        .build()
        .await
        .expect("connect through the proxy");
    assert_eq!(
        transport.send(&[fx.deliverable(0)]).await,
        vec![Outcome::Delivered]
    );

    proxy.stall();
    let batch = vec![fx.deliverable(1), fx.deliverable(2)];
    let start = std::time::Instant::now();
    let outcomes = transport.send(&batch).await;
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    for o in &outcomes {
        assert!(
            matches!(o, Outcome::Unavailable(w) if w.contains("no publisher confirm within")),
            "{outcomes:?}"
        );
    }
    let why = transport
        .probe()
        .await
        .expect_err("probe while the broker does not answer")
        .to_string();
    assert!(why.contains("timed out"), "{why}");

    proxy.resume();
    let start = std::time::Instant::now();
    while let Err(e) = transport.probe().await {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never recovered: {e}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(transport.send(&batch).await, vec![Outcome::Delivered; 2]);
    let ids = [batch[0].id, batch[1].id];
    outbox_api::testing::wait_until("re-sent messages arrived", Duration::from_secs(10), || {
        let got = fx.received_ids();
        let ok = ids.iter().all(|id| got.contains(id));
        async move { ok }
    })
    .await;
    fx.cleanup().await;
}

// ------------------------------------------------------------ properties

#[tokio::test]
async fn every_property_reaches_the_consumer() {
    let fx = Fixture::new().await;
    let transport = transport_direct().await;
    let payload = vec![0u8, 159, 146, 150, 255, b'{'];
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let m = stored(
        NewMessage::new(MessageKind::Integration, "OrderPlaced", payload.clone())
            .content_type("application/x-test")
            .key("order-42")
            .trace_parent(tp)
            .header("tenant", "acme")
            .header("x-empty", "")
            .destination(fx.exchange.as_str(), "deliver"),
    );
    assert_eq!(
        transport.send(std::slice::from_ref(&m)).await,
        vec![Outcome::Delivered]
    );
    let got = fx.get().await;
    let p = &got.delivery.properties;
    assert_eq!(
        p.message_id().as_ref().map(|s| s.as_str()),
        Some(m.id.to_string().as_str())
    );
    assert_eq!(p.kind().as_ref().map(|s| s.as_str()), Some("OrderPlaced"));
    assert_eq!(
        p.content_type().as_ref().map(|s| s.as_str()),
        Some("application/x-test")
    );
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    let ts = p.timestamp().expect("timestamp");
    assert_eq!(ts as i64, m.created_at.as_millis() / 1000);
    let headers = p.headers().as_ref().expect("headers");
    let header = |name: &str| match headers.inner().get(name) {
        Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
        other => panic!("header {name}: {other:?}"),
    };
    assert_eq!(header("tenant"), "acme");
    assert_eq!(header("x-empty"), "");
    assert_eq!(header("traceparent"), tp);
    assert_eq!(header("x-outbox-key"), "order-42");
    assert_eq!(headers.inner().len(), 4, "{headers:?}");
    assert_eq!(got.delivery.data, payload);
    assert_eq!(got.delivery.exchange.as_str(), fx.exchange);
    assert_eq!(got.delivery.routing_key.as_str(), "deliver");
    fx.cleanup().await;
}

#[tokio::test]
async fn default_routing_uses_the_default_exchange_and_the_message_type() {
    let fx = Fixture::new().await;
    // A queue named like the message type receives it through the default exchange.
    let message_type = unique("Type");
    fx.channel
        .queue_declare(
            message_type.as_str().into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let transport = transport_direct().await;
    let m = stored(NewMessage::new(
        MessageKind::Integration,
        message_type.as_str(),
        "x",
    ));
    assert_eq!(
        transport.send(std::slice::from_ref(&m)).await,
        vec![Outcome::Delivered]
    );
    // A confirm means the broker has enqueued it; poll with a deadline anyway.
    let start = std::time::Instant::now();
    let got = loop {
        let got = fx
            .channel
            .basic_get(
                message_type.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap();
        if let Some(got) = got {
            break got;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no message in the queue named like its type"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(got.delivery.routing_key.as_str(), message_type);

    // Configured defaults: exchange + fixed routing key.
    let transport = RabbitTransport::builder(broker_url())
        .default_exchange(fx.exchange.as_str())
        .routing_key("deliver")
        .build()
        .await
        .unwrap();
    let m = stored(message(1));
    assert_eq!(
        transport.send(std::slice::from_ref(&m)).await,
        vec![Outcome::Delivered]
    );
    let got = fx.get().await;
    assert_eq!(got.delivery.exchange.as_str(), fx.exchange);
    fx.cleanup().await;
}

#[tokio::test]
async fn unroutable_is_rejected_naming_exchange_and_key() {
    let fx = Fixture::new().await;
    let transport = transport_direct().await;
    let m = fx.unroutable();
    let outcomes = transport.send(std::slice::from_ref(&m)).await;
    match &outcomes[..] {
        [Outcome::Rejected(why)] => {
            assert!(why.contains("unroutable"), "{why}");
            assert!(why.contains(&fx.exchange), "{why}");
            assert!(why.contains("nowhere"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    // Without a destination and no queue named like the type: also rejected.
    let m = stored(NewMessage::new(
        MessageKind::Integration,
        unique("NoSuchQueue"),
        "x",
    ));
    assert!(matches!(
        &transport.send(&[m]).await[..],
        [Outcome::Rejected(_)]
    ));
    fx.cleanup().await;
}

#[tokio::test]
async fn missing_exchange_is_rejected_and_the_transport_keeps_working() {
    let fx = Fixture::new().await;
    fx.consume().await;
    let transport = transport_direct().await;
    let missing = unique("missing");
    let batch = vec![
        fx.deliverable(0),
        stored(message(1).destination(missing.as_str(), "k")),
        fx.deliverable(2),
    ];
    let outcomes = transport.send(&batch).await;
    assert_eq!(outcomes[0], Outcome::Delivered, "{outcomes:?}");
    match &outcomes[1] {
        Outcome::Rejected(why) => {
            assert!(why.contains(&missing), "{why}");
            assert!(why.contains("does not exist"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(outcomes[2], Outcome::Delivered, "{outcomes:?}");

    // An exchange deleted after the transport checked it: the broker closes the channel.
    let doomed = fx.extra_exchange().await;
    let warm = stored(message(3).destination(doomed.as_str(), "k"));
    assert!(
        matches!(&transport.send(&[warm]).await[..], [Outcome::Rejected(w)] if w.contains("unroutable"))
    );
    fx.channel
        .exchange_delete(doomed.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let batch = vec![
        fx.deliverable(4),
        stored(message(5).destination(doomed.as_str(), "k")),
        fx.deliverable(6),
    ];
    let outcomes = transport.send(&batch).await;
    eprintln!("after the exchange was deleted: {outcomes:?}");
    match &outcomes[1] {
        Outcome::Rejected(why) => assert!(why.contains(&doomed), "{why}"),
        other => panic!("{outcomes:?} {other:?}"),
    }
    for i in [0, 2] {
        assert!(
            matches!(outcomes[i], Outcome::Delivered | Outcome::Unavailable(_)),
            "{outcomes:?}"
        );
    }
    // Still usable: the unconfirmed ones go out again.
    let again: Vec<Message> = [0, 2]
        .into_iter()
        .filter(|&i| outcomes[i] != Outcome::Delivered)
        .map(|i| batch[i].clone())
        .chain([fx.deliverable(7)])
        .collect();
    transport
        .probe()
        .await
        .expect("probe after a channel close");
    let outcomes = transport.send(&again).await;
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Delivered),
        "{outcomes:?}"
    );
    let expect: Vec<MessageId> = again.iter().map(|m| m.id).collect();
    outbox_api::testing::wait_until("all arrived", Duration::from_secs(10), || {
        let got = fx.received_ids();
        let ok = expect.iter().all(|id| got.contains(id));
        async move { ok }
    })
    .await;
    fx.cleanup().await;
}

#[tokio::test]
async fn unencodable_header_rejects_only_that_message() {
    let fx = Fixture::new().await;
    fx.consume().await;
    let transport = transport_direct().await;
    let long_name = "h".repeat(256);
    let mut bad = fx.deliverable(1);
    bad.headers.insert(long_name, "v".into());
    let mut huge = fx.deliverable(3);
    huge.headers.insert("big".into(), "x".repeat(200_000));
    let batch = vec![fx.deliverable(0), bad, fx.deliverable(2), huge];
    let outcomes = transport.send(&batch).await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert!(
        matches!(&outcomes[1], Outcome::Rejected(w) if w.contains("header name")),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[2], Outcome::Delivered);
    assert!(
        matches!(&outcomes[3], Outcome::Rejected(w) if w.contains("frame")),
        "{outcomes:?}"
    );
    outbox_api::testing::wait_until("two arrived", Duration::from_secs(10), || {
        let n = fx.received_ids().len();
        async move { n >= 2 }
    })
    .await;
    // The connection survived; and what follows on the same channel and
    // queue arrives after anything published before it, so once it is
    // there, the refused ones would have been too.
    let marker = fx.deliverable(4);
    assert_eq!(
        transport.send(std::slice::from_ref(&marker)).await,
        vec![Outcome::Delivered]
    );
    outbox_api::testing::wait_until("the marker arrived", Duration::from_secs(10), || {
        let n = fx.received_ids().len();
        async move { n >= 3 }
    })
    .await;
    assert_eq!(
        fx.received_ids(),
        vec![batch[0].id, batch[2].id, marker.id],
        "the refused messages were never published"
    );
    fx.cleanup().await;
}

#[tokio::test]
async fn a_large_batch_is_pipelined() {
    let fx = Fixture::new().await;
    fx.consume().await;
    let transport = transport_direct().await;
    let batch: Vec<Message> = (0..500).map(|n| fx.deliverable(n)).collect();
    let start = std::time::Instant::now();
    let outcomes = transport.send(&batch).await;
    eprintln!("500 persistent messages confirmed in {:?}", start.elapsed());
    assert!(outcomes.iter().all(|o| *o == Outcome::Delivered));
    let ids: Vec<MessageId> = batch.iter().map(|m| m.id).collect();
    outbox_api::testing::wait_until("all 500 arrived", Duration::from_secs(20), || {
        let n = fx.received_ids().len();
        async move { n >= 500 }
    })
    .await;
    assert_eq!(fx.received_ids(), ids, "arrival order");
    fx.cleanup().await;
}

// ------------------------------------------------------------ configuration

#[tokio::test]
async fn wrong_credentials_fail_clearly_without_the_password() {
    let uri: lapin::uri::AMQPUri = broker_url().parse().unwrap();
    let secret = "wr0ng-Pa55word-x7";
    let url = format!(
        "amqp://{}:{secret}@{}:{}/{}",
        percent_encode(&uri.authority.userinfo.username),
        uri.authority.host,
        uri.authority.port,
        percent_encode(&uri.vhost)
    );
    let err = RabbitTransport::builder(url.as_str())
        .build()
        .await
        .unwrap_err();
    let text = format!("{err} / {err:?}");
    eprintln!("{text}");
    assert_eq!(err.kind(), ErrorKind::Config, "{text}");
    assert!(
        text.contains(&format!(
            "authentication failed for user `{}`",
            uri.authority.userinfo.username
        )),
        "{text}"
    );
    assert!(text.contains(&uri.authority.host), "{text}");
    assert!(!text.contains(secret), "{text}");

    // A lazily built transport reports it from probe, also without the password.
    let lazy = RabbitTransport::builder(url.as_str()).build_lazy().unwrap();
    let why = lazy.probe().await.unwrap_err().to_string();
    assert!(why.contains("authentication failed"), "{why}");
    assert!(!why.contains(secret), "{why}");
    let outcomes = lazy.send(&[stored(message(0))]).await;
    assert!(
        matches!(&outcomes[..], [Outcome::Unavailable(w)] if !w.contains(secret)),
        "{outcomes:?}"
    );
    assert!(!format!("{lazy:?}").contains(secret));
}

#[tokio::test]
async fn logs_never_contain_the_password() {
    let (logs, _guard) = outbox_api::testing::LogBuffer::capture_all();

    let uri: lapin::uri::AMQPUri = broker_url().parse().unwrap();
    let secret = "l0gged-Pa55word-q9";
    let wrong = format!(
        "amqp://{}:{secret}@{}:{}/{}",
        percent_encode(&uri.authority.userinfo.username),
        uri.authority.host,
        uri.authority.port,
        percent_encode(&uri.vhost)
    );
    let lazy = RabbitTransport::builder(wrong.as_str())
        .reconnect_backoff(Duration::from_millis(1), Duration::from_millis(1))
        .build_lazy()
        .unwrap();
    let _ = lazy.send(&[stored(message(0))]).await;
    let _ = lazy.probe().await;
    let unreachable = format!("amqp://someone:{secret}@127.0.0.1:1/%2f");
    let _ = RabbitTransport::builder(unreachable.as_str()).build().await;
    let _ = RabbitTransport::builder(format!("amqp://someone:{secret}@h:bad/x"))
        .build()
        .await;
    tracing::info!(transport = ?lazy, "debug of a transport");

    let text = logs.text();
    assert!(text.contains("connecting to RabbitMQ failed"), "{text}");
    assert!(text.contains(":***@"), "{text}");
    assert!(!text.contains(secret), "{text}");
}

#[tokio::test]
async fn malformed_url_is_a_config_error_with_the_password_redacted() {
    let err = RabbitTransport::builder("amqp://user:s3cr3t-pw@broker:notaport/%2f")
        .build()
        .await
        .unwrap_err();
    let text = format!("{err} / {err:?}");
    assert_eq!(err.kind(), ErrorKind::Config, "{text}");
    assert!(text.contains("user:***@broker"), "{text}");
    assert!(!text.contains("s3cr3t-pw"), "{text}");
}

#[tokio::test]
async fn unreachable_broker_fails_clearly() {
    // Port 1 on loopback: connection refused.
    let err = RabbitTransport::builder("amqp://guest:p4ssw0rd-x@127.0.0.1:1/%2f")
        .connect_timeout(Duration::from_secs(3))
        .build()
        .await
        .unwrap_err();
    let text = format!("{err} / {err:?}");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{text}");
    assert!(
        text.contains("cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:1"),
        "{text}"
    );
    assert!(!text.contains("p4ssw0rd-x"), "{text}");
}

#[tokio::test]
async fn from_env_reads_outbox_amqp_url() {
    let url = broker_url();
    if std::env::var(outbox_rabbitmq::URL_ENV).is_err() {
        // The broker was found without the variable: run this test again
        // in a child process that has it.
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "from_env_reads_outbox_amqp_url", "--nocapture"])
            .env(outbox_rabbitmq::URL_ENV, &url)
            .status()
            .expect("run the test binary again");
        assert!(
            status.success(),
            "with {} set: {status}",
            outbox_rabbitmq::URL_ENV
        );
        return;
    }
    let config = RabbitConfig::from_env().expect("valid OUTBOX_AMQP_URL");
    let transport = config.build().await.unwrap();
    transport.probe().await.unwrap();
    let debug = format!("{transport:?}");
    assert!(debug.contains("connected: true"), "{debug}");
    let uri: lapin::uri::AMQPUri = broker_url().parse().unwrap();
    let info = &uri.authority.userinfo;
    // Checked where the password would stand, so that it holds for
    // `guest:guest` too (a password equal to the user name shows as the
    // user name elsewhere).
    assert!(
        !debug.contains(&format!("{}:{}@", info.username, info.password)),
        "{debug}"
    );
    assert!(
        debug.contains(&format!("{}:***@", info.username)),
        "{debug}"
    );
    if info.password.len() >= 3 && !info.username.contains(&info.password) {
        assert!(!debug.contains(&info.password), "{debug}");
    }
}

// ------------------------------------------------------------ topology

#[tokio::test]
async fn topology_declares_durable_exchanges_queues_bindings_and_dead_letters() {
    let fx = Fixture::new().await;
    let transport = transport_direct().await;
    let (x, dlx, q, dlq) = (
        unique("orders"),
        unique("dlx"),
        unique("wh"),
        unique("dead"),
    );
    let topology = Topology::new()
        .exchange(x.as_str(), ExchangeType::Topic)
        .exchange(dlx.as_str(), ExchangeType::Fanout)
        .queue(q.as_str())
        .queue(dlq.as_str())
        .bind(q.as_str(), x.as_str(), "order.*")
        .bind(dlq.as_str(), dlx.as_str(), "")
        .dead_letter(q.as_str(), dlx.as_str());
    transport.declare(&topology).await.expect("declare");
    transport
        .declare(&topology)
        .await
        .expect("declaring twice is fine");

    let m = stored(message(0).destination(x.as_str(), "order.placed"));
    assert_eq!(
        transport.send(std::slice::from_ref(&m)).await,
        vec![Outcome::Delivered]
    );
    let get = |queue: String| {
        let channel = fx.channel.clone();
        async move {
            for _ in 0..300 {
                if let Some(g) = channel
                    .basic_get(queue.as_str().into(), BasicGetOptions::default())
                    .await
                    .unwrap()
                {
                    return g;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("nothing in {queue}");
        }
    };
    let got = get(q.clone()).await;
    assert_eq!(
        got.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string()),
        Some(m.id.to_string())
    );
    got.delivery
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = get(dlq.clone()).await;
    assert_eq!(
        dead.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string()),
        Some(m.id.to_string())
    );
    dead.delivery.acker.ack(Default::default()).await.unwrap();

    // A conflicting redeclaration fails with a clear error.
    let err = transport
        .declare(&Topology::new().exchange(x.as_str(), ExchangeType::Fanout))
        .await
        .unwrap_err();
    assert!(err.to_string().contains(&x), "{err}");

    for queue in [&q, &dlq] {
        fx.channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    for exchange in [&x, &dlx] {
        fx.channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }
    fx.cleanup().await;
}
