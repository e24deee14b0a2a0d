//! The NATS transport against a real server: the transport conformance
//! suite (through a TCP proxy that cuts the connection), and what is
//! particular to JetStream — headers, `Nats-Msg-Id` deduplication, stream
//! refusals, the server's size limit, stream provisioning, logins.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use outbox_api::testing::{TcpProxy, TransportUnderTest};
use outbox_api::{Message, MessageId, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_nats::testing::{TestStream, header, nats_url, server_addr, unique_name};
use outbox_nats::{NatsConfig, NatsTransport, StreamSpec};

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

/// A stream of the test's own capturing `{name}.>`, read back directly.
struct Fixture {
    stream: TestStream,
    name: String,
    js: jetstream::Context,
}

impl Fixture {
    async fn new() -> Fixture {
        let stream = TestStream::new("tx").await;
        let (name, js) = (stream.name.clone(), stream.js.clone());
        Fixture { stream, name, js }
    }

    fn deliverable(&self, n: usize) -> Message {
        stored(message(n).destination(self.name.as_str(), "deliver"))
    }

    /// No stream captures `{name}-none.x`.
    fn rejectable(&self) -> Message {
        stored(message(999).destination(format!("{}-none", self.name), "x"))
    }

    async fn stored(&self) -> Vec<jetstream::message::StreamMessage> {
        self.stream.stored().await
    }

    async fn ids(&self) -> Vec<MessageId> {
        self.stream.ids().await
    }

    async fn cleanup(&self) {
        self.stream.delete().await;
    }
}

async fn connect(config: NatsConfig) -> NatsTransport {
    NatsTransport::connect(config)
        .await
        .expect("connect the transport")
}

// ------------------------------------------------------------ conformance

struct UnderTest {
    fixture: Fixture,
    proxy: TcpProxy,
    transport: Arc<NatsTransport>,
}

async fn under_test() -> UnderTest {
    let fixture = Fixture::new().await;
    let proxy = TcpProxy::start(server_addr(&nats_url())).await;
    let transport = connect(
        NatsTransport::builder(format!("nats://{}", proxy.addr()))
            .ack_timeout(Duration::from_secs(2))
            .connect_timeout(Duration::from_secs(2))
            .max_reconnect_delay(Duration::from_millis(200)),
    )
    .await;
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
        self.fixture.rejectable()
    }
    async fn break_connection(&self) {
        self.proxy.cut();
        // The client notices a cut connection at its next read; wait until it has.
        let transport = self.transport.clone();
        outbox_api::testing::wait_until("the client to see the cut", Duration::from_secs(10), || {
            let t = transport.clone();
            async move {
                t.client().connection_state() != async_nats::connection::State::Connected
            }
        })
        .await;
    }
    async fn heal_connection(&self) {
        self.proxy.heal();
    }
    async fn received(&self) -> Vec<MessageId> {
        self.fixture.ids().await
    }
}

mod conformance {
    use super::*;
    outbox_api::transport_conformance_tests!(under_test);
}

// ------------------------------------------------------------ JetStream

#[tokio::test]
async fn headers_carry_the_message_and_the_subject_follows_the_destination() {
    let fx = Fixture::new().await;
    let t = connect(NatsTransport::builder(nats_url())).await;
    let m = stored(
        message(1)
            .destination(fx.name.as_str(), "orders.placed")
            .key("order-7")
            .header("x-tenant", "acme")
            .trace_parent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    );
    assert_eq!(
        t.send(std::slice::from_ref(&m)).await,
        vec![Outcome::Delivered]
    );
    let got = fx.stored().await;
    assert_eq!(got.len(), 1);
    let h = &got[0].headers;
    let header = |name: &str| header(h, name);
    assert_eq!(
        got[0].subject.as_str(),
        format!("{}.orders.placed", fx.name)
    );
    assert_eq!(header("Nats-Msg-Id"), Some(m.id.to_string()));
    assert_eq!(header("Outbox-Type"), Some("TestMessage".into()));
    assert_eq!(header("Outbox-Key"), Some("order-7".into()));
    assert_eq!(header("Content-Type"), Some(m.content_type.clone()));
    assert_eq!(header("x-tenant"), Some("acme".into()));
    assert_eq!(header("traceparent"), m.trace_parent.clone());
    assert_eq!(
        header("Outbox-Created-At"),
        Some(m.created_at.as_millis().to_string())
    );
    assert_eq!(got[0].payload.as_ref(), b"payload 1");
    fx.cleanup().await;
}

#[tokio::test]
async fn a_message_sent_again_within_the_window_is_stored_once_and_counts_as_delivered() {
    let fx = Fixture::new().await;
    let t = connect(NatsTransport::builder(nats_url())).await;
    let m = fx.deliverable(1);
    assert_eq!(
        t.send(std::slice::from_ref(&m)).await,
        vec![Outcome::Delivered]
    );
    // As a relay that crashed before recording the delivery would.
    assert_eq!(
        t.send(std::slice::from_ref(&m)).await,
        vec![Outcome::Delivered]
    );
    assert_eq!(fx.ids().await, vec![m.id]);
    fx.cleanup().await;
}

#[tokio::test]
async fn the_default_subject_is_prefix_and_type_and_can_be_replaced() {
    let fx = Fixture::new().await;
    let t =
        connect(NatsTransport::builder(nats_url()).subject_prefix(format!("{}.events", fx.name)))
            .await;
    let m = stored(message(1));
    assert_eq!(
        t.send(std::slice::from_ref(&m)).await,
        vec![Outcome::Delivered]
    );
    let name = fx.name.clone();
    let t2 =
        connect(NatsTransport::builder(nats_url()).subject_with(move |m| {
            format!("{name}.by-key.{}", m.key.as_deref().unwrap_or("none"))
        }))
        .await;
    let keyed = stored(message(2).key("k9"));
    assert_eq!(
        t2.send(std::slice::from_ref(&keyed)).await,
        vec![Outcome::Delivered]
    );
    let subjects: Vec<String> = fx
        .stored()
        .await
        .iter()
        .map(|m| m.subject.to_string())
        .collect();
    assert_eq!(
        subjects,
        vec![
            format!("{}.events.TestMessage", fx.name),
            format!("{}.by-key.k9", fx.name)
        ]
    );
    fx.cleanup().await;
}

#[tokio::test]
async fn refusals_tied_to_one_message_are_rejected_and_spare_the_others() {
    let fx = Fixture::new().await;
    // A stream that refuses messages over 100 bytes.
    let small = unique_name("small");
    fx.js
        .create_stream(jetstream::stream::Config {
            name: small.clone(),
            subjects: vec![format!("{small}.>")],
            max_message_size: 100,
            storage: jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .unwrap();
    let t = connect(NatsTransport::builder(nats_url())).await;
    let max_payload = t.client().server_info().max_payload;
    let too_big_for_stream = NewMessage::new(MessageKind::Integration, "T", vec![b'a'; 500])
        .destination(small.as_str(), "x");
    let too_big_for_server =
        NewMessage::new(MessageKind::Integration, "T", vec![b'b'; max_payload + 1])
            .destination(fx.name.as_str(), "deliver");
    // Headers NATS cannot carry (set on the stored message: a store may
    // hold what another transport accepts).
    let with_header = |name: &str, value: &str| {
        let mut m = stored(message(5).destination(fx.name.as_str(), "ok"));
        m.headers.insert(name.to_owned(), value.to_owned());
        m
    };
    let batch = vec![
        fx.deliverable(0),
        fx.rejectable(),
        stored(too_big_for_stream),
        stored(too_big_for_server),
        stored(message(4).destination(fx.name.as_str(), "a..b")),
        with_header("bad name", "v"),
        with_header("h", "line\r\nbreak"),
        fx.deliverable(7),
    ];
    let outcomes = t.send(&batch).await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert_eq!(outcomes[7], Outcome::Delivered);
    let why = |i: usize| match &outcomes[i] {
        Outcome::Rejected(w) => w.clone(),
        other => panic!("message {i}: {other:?} ({outcomes:?})"),
    };
    assert!(
        why(1).contains("no JetStream stream captures subject"),
        "{}",
        why(1)
    );
    assert!(why(2).contains("JetStream refused it"), "{}", why(2));
    assert!(why(3).contains("max_payload"), "{}", why(3));
    assert!(why(4).contains("empty token"), "{}", why(4));
    assert!(why(5).contains("header name"), "{}", why(5));
    assert!(why(6).contains("line break"), "{}", why(6));
    assert_eq!(fx.ids().await, vec![batch[0].id, batch[7].id]);
    // The connection survived the oversized message.
    assert_eq!(t.send(&[fx.deliverable(8)]).await, vec![Outcome::Delivered]);
    let _ = fx.js.delete_stream(&small).await;
    fx.cleanup().await;
}

#[tokio::test]
async fn declare_creates_a_stream_and_explains_a_short_duplicate_window() {
    let t = connect(NatsTransport::builder(nats_url())).await;
    let name = unique_name("decl");
    let spec = StreamSpec::new(name.as_str(), [format!("{name}.>")])
        .covering(Duration::from_secs(200), Duration::from_secs(30));
    t.declare(&spec).await.expect("create");
    t.declare(&spec).await.expect("an equal stream passes");
    let mut stream = t.jetstream().get_stream(&name).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.duplicate_window, Duration::from_secs(230));
    assert_eq!(config.storage, jetstream::stream::StorageType::File);

    let wider = StreamSpec::new(name.as_str(), [format!("{name}.>")])
        .duplicate_window(Duration::from_secs(600));
    let e = t.declare(&wider).await.unwrap_err();
    assert_eq!(e.kind(), outbox_api::ErrorKind::Config);
    assert!(e.to_string().contains("--dupe-window 600s"), "{e}");
    let other = StreamSpec::new(name.as_str(), [format!("{name}-other.>")]);
    let e = t.declare(&other).await.unwrap_err();
    assert!(e.to_string().contains("does not capture"), "{e}");
    t.jetstream().delete_stream(&name).await.unwrap();
}

#[tokio::test]
async fn connection_errors_are_clear_and_never_show_the_password() {
    // Nothing listens on a port just freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = NatsTransport::connect(
        NatsTransport::builder(format!("nats://app:pw-SECRET-1@127.0.0.1:{port}"))
            .connect_timeout(Duration::from_millis(500)),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), outbox_api::ErrorKind::Unavailable, "{e}");
    assert!(!e.to_string().contains("pw-SECRET-1"), "{e}");
    assert!(e.to_string().contains("cannot connect to NATS"), "{e}");

    let e = NatsTransport::connect(NatsTransport::builder("http://127.0.0.1:4222"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), outbox_api::ErrorKind::Config, "{e}");
}

/// Sends larger than the window, several at once, all complete: a send
/// waiting for a permit never holds back the acknowledgements that would
/// free one (its own included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sends_larger_than_the_window_all_complete() {
    let fx = Fixture::new().await;
    let t = Arc::new(connect(NatsTransport::builder(nats_url()).window(4)).await);
    let batches: Vec<Vec<Message>> = (0..3)
        .map(|b| (0..10).map(|n| fx.deliverable(b * 100 + n)).collect())
        .collect();
    let sends = batches.iter().map(|batch| {
        let t = t.clone();
        async move { t.send(batch).await }
    });
    let outcomes = tokio::time::timeout(
        Duration::from_secs(30),
        futures_util::future::join_all(sends),
    )
    .await
    .expect("every send completes");
    for o in outcomes {
        assert_eq!(o, vec![Outcome::Delivered; 10]);
    }
    assert_eq!(fx.ids().await.len(), 30);
    fx.cleanup().await;
}
