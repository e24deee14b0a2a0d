//! The operations artifacts in `ops/` name only what the code exports: a
//! relay runs through deliveries, failures, poison, an uncounted release
//! and a transport outage under the Prometheus recorder of
//! `outbox::metrics::prometheus_recorder` (Prometheus naming, histograms
//! with buckets); every metric and label name in the Grafana dashboard's
//! queries and in the alert rules must be in that scrape, and no metric is
//! a summary. (`promtool check rules` checks the rules' syntax in CI.)

use std::collections::BTreeSet;
use std::time::Duration;

use outbox::memory::{MemoryStore, MemoryTransport};
use outbox::{
    HandlerError, Handlers, ManualClock, Message, MessageKind, NewMessage, Relay, RetryPolicy,
    TemporarilyUnavailable, Timestamp,
};

/// A scrape after a relay met every outcome.
fn scrape() -> String {
    let recorder = outbox::metrics::prometheus_recorder();
    let handle = recorder.handle();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        outbox::metrics::describe();
        rt.block_on(async {
            let clock =
                std::sync::Arc::new(ManualClock::new(Timestamp::from_millis(1_800_000_000_000)));
            let store = MemoryStore::with_clock(clock.clone());
            let (transport, broker) = MemoryTransport::new();
            broker.reject_type("Refused");
            let handlers = Handlers::new()
                .on_message("Ok", |_: &Message| async { Ok::<_, HandlerError>(()) })
                .on_message("Later", |_: &Message| async {
                    Err::<(), HandlerError>(TemporarilyUnavailable::new("busy").into())
                });
            let relay = Relay::builder(store.clone())
                .name("orders")
                .clock(clock.clone())
                .dispatcher(handlers)
                .transport(transport)
                .max_attempts(1)
                .retry_policy(RetryPolicy::NextRound)
                .probe_initial(Duration::from_millis(10))
                .probe_max(Duration::from_millis(20))
                .build()
                .unwrap();
            let mut tx = store.begin();
            for (kind, ty) in [
                (MessageKind::Domain, "Ok"),
                (MessageKind::Domain, "Later"),
                (MessageKind::Integration, "Shipped"),
                (MessageKind::Integration, "Refused"),
            ] {
                tx.enqueue(NewMessage::new(kind, ty, b"{}".to_vec()))
                    .unwrap();
            }
            tx.commit().unwrap();
            clock.advance(Duration::from_secs(3));
            relay.drain().await.unwrap();
            broker.set_down("broker gone");
            let mut tx = store.begin();
            tx.enqueue(NewMessage::new(
                MessageKind::Integration,
                "Shipped",
                b"{}".to_vec(),
            ))
            .unwrap();
            tx.commit().unwrap();
            clock.advance(Duration::from_secs(3));
            relay.drain().await.unwrap();
            relay.health().await;
        })
    });
    handle.render()
}

/// The metric and label names of an exposition.
fn exported(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut metrics, mut labels) = (BTreeSet::new(), BTreeSet::new());
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        metrics.insert(line[..name_end].to_owned());
        if let Some(rest) = line[name_end..].strip_prefix('{') {
            for pair in rest.split("\",") {
                if let Some((label, _)) = pair.split_once("=\"") {
                    labels.insert(label.trim_start_matches(',').to_owned());
                }
            }
        }
    }
    (metrics, labels)
}

/// The `outbox_…` and `messaging_…` identifiers of a query.
fn identifiers(query: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = query.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            let word = &query[start..i];
            let quoted = start > 0 && bytes[start - 1] == b'"';
            if !quoted && (word.starts_with("outbox_") || word.starts_with("messaging_")) {
                out.push(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    out
}

fn queries() -> Vec<(String, String)> {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut out = Vec::new();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{root}/ops/grafana/outbox-dashboard.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let title = panel["title"].as_str().unwrap_or_default();
            out.push((
                format!("dashboard panel `{title}`"),
                target["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = variable["definition"].as_str() {
            out.push(("dashboard variable".to_owned(), q.to_owned()));
        }
    }
    let rules =
        std::fs::read_to_string(format!("{root}/ops/prometheus/outbox-alerts.yml")).unwrap();
    for line in rules.lines() {
        if let Some(expr) = line.trim().strip_prefix("expr:") {
            out.push(("alert rule".to_owned(), expr.trim().to_owned()));
        }
    }
    out
}

#[test]
fn the_dashboard_and_the_alert_rules_name_only_exported_metrics() {
    let text = scrape();
    let (metrics, labels) = exported(&text);
    assert!(
        !text.contains(" summary\n"),
        "no metric is a summary (histograms add up across relays):\n{text}"
    );
    let queries = queries();
    assert!(queries.len() >= 15, "{queries:?}");
    for (place, query) in &queries {
        for name in identifiers(query) {
            assert!(
                metrics.contains(&name) || labels.contains(&name),
                "{place}: `{name}` in `{query}` is neither a metric nor a label the relay exports.\nmetrics: {metrics:?}\nlabels: {labels:?}"
            );
        }
    }
    // The alerts of DESIGN: Degraded (5 minutes), poison waiting, transport down.
    let rules: Vec<&String> = queries
        .iter()
        .filter(|(p, _)| p == "alert rule")
        .map(|(_, q)| q)
        .collect();
    assert!(
        rules
            .iter()
            .any(|q| q.contains("outbox_oldest_pending_age_seconds") && q.contains("> 300")),
        "{rules:?}"
    );
    assert!(
        rules.iter().any(|q| q.contains("outbox_poisoned")),
        "{rules:?}"
    );
    assert!(
        rules.iter().any(|q| q.contains("outbox_transport_up")),
        "{rules:?}"
    );
}

#[test]
fn prometheus_names_carry_units_and_counters_end_in_total() {
    let (metrics, _) = exported(&scrape());
    for name in [
        "outbox_messages_delivered_total",
        "outbox_messages_failed_total",
        "outbox_messages_poisoned_total",
        "outbox_messages_released_total",
        "outbox_delivery_lag_seconds_bucket",
        "messaging_process_duration_seconds_bucket",
        "messaging_client_operation_duration_seconds_bucket",
        "outbox_claim_size_bucket",
        "outbox_oldest_pending_age_seconds",
        "outbox_pending",
        "outbox_transport_up",
    ] {
        assert!(metrics.contains(name), "`{name}` not in {metrics:?}");
    }
}
