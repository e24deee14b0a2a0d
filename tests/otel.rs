//! Trace propagation (feature `opentelemetry`, on in the tests): the trace id
//! at enqueue equals the trace id in the handler's span, and the delivery
//! span is a child of the enqueuing span.

use std::sync::{Arc, Mutex};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outbox::memory::MemoryStore;
use outbox::{Handlers, Message, MessageKind, NewMessage, OperatorStore, Relay};
use tracing_subscriber::layer::SubscriberExt;

#[tokio::test(flavor = "current_thread")]
async fn trace_continues_from_enqueue_to_handler() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let store = MemoryStore::new();
    let id = {
        let span = tracing::info_span!("place_order");
        let _entered = span.enter();
        let mut tx = store.begin();
        let id = tx
            .enqueue(NewMessage::new(
                MessageKind::Domain,
                "OrderPlaced",
                b"{}".to_vec(),
            ))
            .unwrap();
        tx.commit().unwrap();
        id
    };
    let stored = store
        .get(id)
        .await
        .unwrap()
        .unwrap()
        .trace_parent
        .expect("traceparent captured at enqueue");
    let enqueue_trace = stored.split('-').nth(1).unwrap().to_owned();
    let enqueue_span = stored.split('-').nth(2).unwrap().to_owned();

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
        in_handler.split('-').nth(1).unwrap(),
        enqueue_trace,
        "same trace id in the handler"
    );

    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let deliver = spans
        .iter()
        .find(|s| s.name == "outbox.deliver")
        .expect("a delivery span was exported");
    assert_eq!(deliver.span_context.trace_id().to_string(), enqueue_trace);
    assert_eq!(
        deliver.parent_span_id.to_string(),
        enqueue_span,
        "the delivery span is a child of the enqueuing span"
    );
}

#[test]
fn without_a_span_nothing_is_captured() {
    let m = NewMessage::new(MessageKind::Domain, "T", b"x".to_vec())
        .into_message(outbox::Timestamp::now())
        .unwrap();
    assert_eq!(m.trace_parent, None);
}
