//! End-to-end tests of the `minishop` binary's traces: every message of a
//! saga carries the trace of the request that began it (outbox rows and
//! JSON logs), and the spans exported over OTLP are one trace per order,
//! on SQLite and PostgreSQL, over the embedded bus, RabbitMQ and NATS.
//!
//! Brokers and databases as in `minishop.rs`: the tests fail saying how to
//! provide one, never skip.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

/// (message type, trace_parent) of every outbox row of `table` in the
/// SQLite file `db` whose payload names `order`.
fn outbox_traces(db: &std::path::Path, table: &str, order: &str) -> Vec<(String, Option<String>)> {
    use outbox::sqlite::sqlx::{self, Connection};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let url = format!("sqlite://{}?mode=ro", db.display());
        let mut c = sqlx::SqliteConnection::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
        // `table` is one of the test's own two names.
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT message_type, trace_parent FROM {table} \
             WHERE CAST(payload AS TEXT) LIKE '%' || ?1 || '%' ORDER BY seq"
        )))
        .bind(order)
        .fetch_all(&mut c)
        .await
        .unwrap_or_else(|e| panic!("read {table}: {e}"))
    })
}

/// The trace id (32 hex digits) of a W3C `traceparent`.
fn trace_id(traceparent: &str) -> &str {
    traceparent.split('-').nth(1).unwrap_or("")
}

#[test]
fn every_message_of_a_saga_carries_the_requests_trace_and_json_logs_show_it() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let dir = tempfile::tempdir().unwrap();
    let (child, addr) = serve_http_with(
        dir.path(),
        &["--log-format", "json"],
        &[("RUST_LOG", "warn,minishop=debug")],
    );
    let traced = order_to_the_end_with(
        &addr,
        &format!("traceparent: 00-{TRACE}-00f067aa0ba902b7-01\r\n"),
    );
    let untraced = order_to_the_end_with(&addr, "");
    let f = interrupt(child);

    let rows = |id: &str| {
        let mut rows = outbox_traces(&dir.path().join("ordering.db"), "ordering_outbox", id);
        let warehouse = outbox_traces(&dir.path().join("warehouse.db"), "warehouse_outbox", id);
        assert!(
            !warehouse.is_empty() && rows.len() >= 2,
            "order {id}: the ordering module enqueues OrderPlaced and OrderConfirmed, the \
             warehouse its answer: {rows:?} {warehouse:?}"
        );
        rows.extend(warehouse);
        rows
    };
    // The order placed with a traceparent: every message of its saga, in
    // both modules, carries that trace.
    for (kind, tp) in rows(&traced) {
        let tp = tp.unwrap_or_else(|| panic!("{kind} of the traced order has no trace_parent"));
        assert_eq!(trace_id(&tp), TRACE, "{kind}: {tp}");
    }
    // The order placed without one: a trace of its own, the same for its
    // whole saga.
    let untraced_rows = rows(&untraced);
    let first = untraced_rows[0].1.clone().expect("a trace_parent");
    assert_ne!(trace_id(&first), TRACE);
    for (kind, tp) in &untraced_rows {
        let tp = tp
            .as_deref()
            .unwrap_or_else(|| panic!("{kind} has no trace_parent"));
        assert_eq!(
            trace_id(tp),
            trace_id(&first),
            "{kind}: one trace for one saga"
        );
    }

    // JSON logs: every line an object; the handler's line for the traced
    // order holds its trace id (from the delivery span it was logged in).
    let lines: Vec<serde_json::Value> = f
        .stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(json)
        .collect();
    let confirmed: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| {
            l["fields"]["message"] == "order confirmed" && l["fields"]["order"] == traced.as_str()
        })
        .collect();
    assert_eq!(
        confirmed.len(),
        1,
        "one JSON line for the traced order's confirmation:\n{}",
        f.stderr
    );
    assert!(
        confirmed[0].to_string().contains(TRACE),
        "the line carries the trace id: {}",
        confirmed[0]
    );
}

/// One span as an OTLP receiver got it.
#[derive(Debug, Clone)]
struct ExportedSpan {
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    name: String,
    message_type: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An OTLP/HTTP receiver of the test's own on a free port: takes
/// `POST /v1/traces` with a protobuf `ExportTraceServiceRequest`, decodes
/// it and keeps the spans; answers 200 with an empty response.
fn otlp_receiver() -> (String, std::sync::Arc<std::sync::Mutex<Vec<ExportedSpan>>>) {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use prost::Message as _;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = std::sync::Arc::clone(&spans);
    thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            let kept = std::sync::Arc::clone(&kept);
            thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut stream = stream;
                // One request after another on a kept-alive connection.
                loop {
                    let mut request_line = String::new();
                    if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        reader.read_line(&mut line).unwrap();
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = line.split_once(':') {
                            if k.eq_ignore_ascii_case("content-length") {
                                length = v.trim().parse().unwrap();
                            }
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    assert!(
                        request_line.starts_with("POST /v1/traces "),
                        "the exporter posts to /v1/traces: {request_line}"
                    );
                    let request = ExportTraceServiceRequest::decode(&body[..])
                        .unwrap_or_else(|e| panic!("not an OTLP trace export: {e}"));
                    let mut got = Vec::new();
                    for rs in request.resource_spans {
                        for ss in rs.scope_spans {
                            for s in ss.spans {
                                let message_type = s
                                    .attributes
                                    .iter()
                                    .find(|a| a.key == "message.type")
                                    .and_then(|a| a.value.as_ref()?.value.as_ref())
                                    .and_then(|v| match v {
                                        Value::StringValue(s) => Some(s.clone()),
                                        _ => None,
                                    });
                                got.push(ExportedSpan {
                                    trace_id: hex(&s.trace_id),
                                    span_id: hex(&s.span_id),
                                    parent_span_id: hex(&s.parent_span_id),
                                    name: s.name,
                                    message_type,
                                });
                            }
                        }
                    }
                    kept.lock().unwrap().extend(got);
                    let _ = stream.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n",
                    );
                }
            });
        }
    });
    (addr, spans)
}

/// Whether `span` descends from the span `ancestor` in `spans`.
fn descends(spans: &[ExportedSpan], span: &ExportedSpan, ancestor: &str) -> bool {
    let mut parent = span.parent_span_id.clone();
    for _ in 0..spans.len() {
        if parent == ancestor {
            return true;
        }
        match spans.iter().find(|s| s.span_id == parent) {
            Some(p) => parent = p.parent_span_id.clone(),
            None => return false,
        }
    }
    false
}

#[test]
fn spans_of_each_saga_are_exported_over_otlp_as_one_trace_from_the_request() {
    saga_traces_over_otlp(&[]);
}

#[test]
fn spans_of_each_saga_through_rabbitmq_are_one_trace_from_the_request() {
    let url = outbox_api::testing::service_url(&outbox_rabbitmq::testing::RABBITMQ);
    saga_traces_over_otlp(&["--amqp", &url, "--isolated"]);
}

#[test]
fn spans_of_each_saga_on_postgresql_are_one_trace_from_the_request() {
    let url = outbox_api::testing::service_url(&outbox_postgres::testing::POSTGRES);
    saga_traces_over_otlp(&["--postgres", &url, "--isolated"]);
}

#[test]
fn spans_of_each_saga_on_postgresql_through_rabbitmq_are_one_trace_from_the_request() {
    let pg = outbox_api::testing::service_url(&outbox_postgres::testing::POSTGRES);
    let amqp = outbox_api::testing::service_url(&outbox_rabbitmq::testing::RABBITMQ);
    saga_traces_over_otlp(&["--postgres", &pg, "--amqp", &amqp, "--isolated"]);
}

#[test]
fn spans_of_each_saga_through_nats_are_one_trace_from_the_request() {
    let url = outbox_api::testing::service_url(&outbox_nats::testing::NATS);
    saga_traces_over_otlp(&["--nats", &url, "--isolated"]);
}

/// Places an order with a `traceparent` and one without through MiniShop's
/// HTTP API (with `args`), and checks what an OTLP receiver of the test's
/// own got: one trace per order, from the request to the confirmation.
fn saga_traces_over_otlp(args: &[&str]) {
    const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
    const CALLER: &str = "b7ad6b7169203331";
    let (endpoint, spans) = otlp_receiver();
    let dir = tempfile::tempdir().unwrap();
    let (child, addr) = serve_http_with(
        dir.path(),
        args,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let traced = order_to_the_end_with(&addr, &format!("traceparent: 00-{TRACE}-{CALLER}-01\r\n"));
    let untraced = order_to_the_end_with(&addr, "");
    // Ctrl-C: MiniShop exports what is left before it exits.
    interrupt(child);
    let spans = spans.lock().unwrap().clone();

    let check = |trace: &str, caller: Option<&str>, order: &str| {
        let of: Vec<ExportedSpan> = spans
            .iter()
            .filter(|s| s.trace_id == trace)
            .cloned()
            .collect();
        let request: Vec<&ExportedSpan> = of.iter().filter(|s| s.name == "POST /orders").collect();
        assert_eq!(
            request.len(),
            1,
            "order {order}: one request span in trace {trace}: {of:#?}"
        );
        let request = request[0];
        assert_eq!(
            request.parent_span_id,
            caller.unwrap_or(""),
            "order {order}: the request span's parent is the caller's span (none without a traceparent)"
        );
        let find = |name: &str, message_type: &str| {
            of.iter()
                .find(|s| s.name == name && s.message_type.as_deref() == Some(message_type))
                .unwrap_or_else(|| {
                    panic!("order {order}: no {name} span of {message_type} in {of:#?}")
                })
        };
        // HTTP request → OrderPlaced enqueued → the warehouse receives it → the ordering
        // module receives its answer → OrderConfirmed delivered.
        let enqueued = find("outbox.enqueue", "OrderPlaced");
        let placed = find("outbox.receive", "OrderPlaced");
        let answer = find("outbox.receive", "StockReserved");
        let confirmed = find("outbox.deliver", "OrderConfirmed");
        for (span, under, what) in [
            (enqueued, request, "OrderPlaced enqueued under the request"),
            (placed, enqueued, "OrderPlaced received under its enqueue"),
            (answer, placed, "the answer under the warehouse's handling"),
            (confirmed, answer, "the confirmation under the answer"),
        ] {
            assert!(descends(&of, span, &under.span_id), "{what}");
        }
    };
    check(TRACE, Some(CALLER), &traced);
    // Without a traceparent, the order's request starts a trace of its own.
    let roots: Vec<&ExportedSpan> = spans
        .iter()
        .filter(|s| s.name == "POST /orders" && s.trace_id != TRACE)
        .collect();
    assert_eq!(
        roots.len(),
        1,
        "one more request, one more trace: {roots:#?}"
    );
    check(&roots[0].trace_id.clone(), None, &untraced);
}

/// Places an apple order over HTTP with extra `headers` and waits until it
/// is confirmed and its confirmation handled; returns its id.
fn order_to_the_end_with(addr: &str, headers: &str) -> String {
    let (status, created) = http_with(
        addr,
        "POST",
        "/orders",
        Some(r#"{"customer":"ann","sku":"apple","qty":1}"#),
        headers,
    );
    assert_eq!(status, 201, "{created}");
    let id = json(&created)["id"].as_str().expect("id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = http(addr, "GET", &format!("/orders/{id}"), None);
        if json(&body).get("confirmed_at").is_some() {
            return id;
        }
        assert!(
            Instant::now() < deadline,
            "order {id} never confirmed: {body}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}
