//! Trace propagation (feature `opentelemetry`, on in the tests): the trace id
//! at enqueue equals the trace id in the handler's span — in-process, and
//! across the relay, RabbitMQ and the consumer — and delivery spans are
//! children of the enqueuing span. Spans go to one in-memory exporter,
//! installed as the global subscriber of this test binary (a thread-local
//! default would race with tracing's callsite cache across test threads);
//! each test finds its own spans by trace id.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox::memory::MemoryStore;
use outbox::{HandlerError, Handlers, Message, MessageKind, NewMessage, OperatorStore, Relay};
use outbox_api::testing::StoreUnderTest;
use outbox_rabbitmq::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use outbox_rabbitmq::lapin::types::FieldTable;
use outbox_rabbitmq::lapin::{Connection, ConnectionProperties};
use outbox_rabbitmq::testing::{amqp_url, unique_name};
use outbox_rabbitmq::{InboxHandler, RabbitConsumer, RabbitTransport, Received};
use outbox_sqlite::sqlx::SqliteConnection;
use outbox_sqlite::testing::SqlxUnderTest;
use tracing_subscriber::layer::SubscriberExt;

struct Tracing {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
}

fn tracing() -> &'static Tracing {
    static TRACING: OnceLock<Tracing> = OnceLock::new();
    TRACING.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
        Tracing { exporter, provider }
    })
}

fn spans_of(trace_id: &str) -> Vec<SpanData> {
    let t = tracing();
    t.provider.force_flush().unwrap();
    t.exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id().to_string() == trace_id)
        .collect()
}

fn part(traceparent: &str, n: usize) -> String {
    traceparent.split('-').nth(n).unwrap().to_owned()
}

#[tokio::test]
async fn trace_continues_from_enqueue_to_handler() {
    tracing();
    let store = MemoryStore::new();
    let (id, place_order) = {
        let span = tracing::info_span!("place_order");
        let _entered = span.enter();
        let place_order = outbox::trace::current_traceparent().expect("a traced span");
        let mut tx = store.begin();
        let id = tx
            .enqueue(NewMessage::new(
                MessageKind::Domain,
                "OrderPlaced",
                b"{}".to_vec(),
            ))
            .unwrap();
        tx.commit().unwrap();
        (id, place_order)
    };
    let stored = store
        .get(id)
        .await
        .unwrap()
        .unwrap()
        .trace_parent
        .expect("traceparent captured at enqueue");
    let (enqueue_trace, enqueue_span) = (part(&stored, 1), part(&stored, 2));

    let seen: Arc<Mutex<Option<String>>> = Default::default();
    let s = seen.clone();
    let handlers = Handlers::new().on_message("OrderPlaced", move |_m: &Message| {
        *s.lock().unwrap() = outbox::trace::current_traceparent();
        async { Ok::<_, std::io::Error>(()) }
    });
    let relay = Relay::builder(store.clone())
        .dispatcher(handlers)
        .build()
        .unwrap();
    assert_eq!(relay.drain().await.unwrap().delivered, 1);

    let in_handler = seen
        .lock()
        .unwrap()
        .clone()
        .expect("the handler runs inside a traced span");
    assert_eq!(
        part(&in_handler, 1),
        enqueue_trace,
        "same trace id in the handler"
    );
    let spans = spans_of(&enqueue_trace);
    let enqueue = spans
        .iter()
        .find(|s| s.name == "outbox.enqueue")
        .expect("an enqueue span was exported");
    assert_eq!(
        enqueue.span_context.span_id().to_string(),
        enqueue_span,
        "the message stores its enqueue span's context"
    );
    assert_eq!(
        enqueue.parent_span_id.to_string(),
        part(&place_order, 2),
        "the enqueue span is a child of the span that enqueued"
    );
    assert!(
        enqueue
            .attributes
            .iter()
            .any(|kv| kv.key.as_str() == "message.type" && kv.value.as_str() == "OrderPlaced"),
        "the enqueue span names the message type: {:?}",
        enqueue.attributes
    );
    let deliver = spans
        .iter()
        .find(|s| s.name == "outbox.deliver")
        .expect("a delivery span was exported");
    assert_eq!(
        deliver.parent_span_id.to_string(),
        enqueue_span,
        "the delivery span is a child of the enqueue span"
    );
}

#[test]
fn without_a_span_nothing_is_captured() {
    let m = NewMessage::new(MessageKind::Domain, "T", b"x".to_vec())
        .into_message(outbox::Timestamp::now())
        .unwrap();
    assert_eq!(m.trace_parent, None);
}

/// Records the trace context the consumer's handler runs in.
#[derive(Clone, Default)]
struct TraceRecorder(Arc<Mutex<Vec<Option<String>>>>);

#[async_trait]
impl InboxHandler<SqliteConnection> for TraceRecorder {
    async fn handle(
        &self,
        _msg: &Received,
        _tx: &mut SqliteConnection,
    ) -> Result<(), HandlerError> {
        self.0
            .lock()
            .unwrap()
            .push(outbox::trace::current_traceparent());
        Ok(())
    }
}

/// Across RabbitMQ: enqueue (SQLite) → relay → RabbitMQ → RabbitConsumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_id_continues_across_rabbitmq() {
    tracing();
    let url = amqp_url();
    let queue = unique_name("otel");
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("connect to OUTBOX_AMQP_URL");
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let producer = SqlxUnderTest::fresh(None).await;
    let receiver = SqlxUnderTest::fresh(None).await;
    let recorder = TraceRecorder::default();
    let consumer = RabbitConsumer::builder(url.clone(), queue.as_str())
        .spawn(
            outbox_sqlite::SqliteInbox::new(receiver.sqlite().outbox(), receiver.pool().clone()),
            recorder.clone(),
        )
        .await
        .expect("start the consumer");
    let transport = RabbitTransport::builder(url.clone())
        .routing_key(queue.clone())
        .build()
        .await
        .unwrap();
    let relay = Relay::builder_shared(producer.store())
        .transport(transport)
        .spawn()
        .unwrap();

    let trace_id = {
        let span = tracing::info_span!("checkout");
        let _entered = span.enter();
        let tp = outbox::trace::current_traceparent().expect("the checkout span is traced");
        // No explicit trace_parent: enqueue captures the current span's.
        producer
            .enqueue(vec![NewMessage::new(
                MessageKind::Integration,
                "Checkout",
                b"{}".to_vec(),
            )])
            .await;
        part(&tp, 1)
    };
    outbox_api::testing::wait_until(
        "the consumer handled the message",
        Duration::from_secs(30),
        || async { !recorder.0.lock().unwrap().is_empty() },
    )
    .await;
    let seen = recorder.0.lock().unwrap()[0]
        .clone()
        .expect("the handler runs in a traced span");
    assert_eq!(part(&seen, 1), trace_id, "same trace id at the consumer");
    relay.shutdown().await;
    consumer.shutdown().await;
    let spans = spans_of(&trace_id);
    for name in ["checkout", "outbox.deliver", "outbox.receive"] {
        assert!(
            spans.iter().any(|s| s.name == name),
            "{name} is part of the trace: {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
    }
    let _ = channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
}
