//! The relay's metrics, read back from a recorder installed for the test's
//! thread only (`outbox_api::testing::TestRecorder`: `metrics::with_local_recorder`
//! around a current-thread runtime, so every task of the relay records
//! into it and no other test does): every counter, gauge and histogram after deliveries, counted
//! failures, poison, a handler that is temporarily unavailable and a
//! transport outage.

use std::sync::Arc;
use std::time::Duration;

use outbox::memory::{MemoryStore, MemoryTransport};
use outbox::metrics as m;
use outbox::{
    HandlerError, Handlers, ManualClock, Message, MessageKind, NewMessage, Relay, RetryPolicy,
    TemporarilyUnavailable, Timestamp,
};
use outbox_api::testing::{TestRecorder, wait_until};

/// Generous: conditions usually hold within milliseconds.
const DEADLINE: Duration = Duration::from_secs(30);

const OUTBOX: &str = "orders";

/// The labels of a per-type metric.
fn of(kind: &'static str, ty: &'static str) -> [(&'static str, &'static str); 3] {
    [
        (m::OUTBOX, OUTBOX),
        (m::MESSAGE_KIND, kind),
        (m::MESSAGE_TYPE, ty),
    ]
}

fn with<'a>(
    labels: [(&'a str, &'a str); 3],
    more: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut l = labels.to_vec();
    l.extend_from_slice(more);
    l
}

fn domain(ty: &str) -> NewMessage {
    NewMessage::new(MessageKind::Domain, ty, b"{}".to_vec())
}

fn integration(ty: &str) -> NewMessage {
    NewMessage::new(MessageKind::Integration, ty, b"{}".to_vec())
}

/// A memory store whose time, and the relay's, moves only when told.
fn store_on_a_manual_clock() -> (Arc<ManualClock>, MemoryStore) {
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_800_000_000_000)));
    let store = MemoryStore::with_clock(clock.clone());
    (clock, store)
}

#[test]
fn the_relay_records_outcomes_durations_claims_and_the_backlog() {
    let rec = TestRecorder::new();
    rec.block_on(async {
        let (clock, store) = store_on_a_manual_clock();
        let (transport, broker) = MemoryTransport::new();
        broker.reject_type("Refused");
        let handlers = Handlers::new()
            .on_message("Ok", |_: &Message| async { Ok::<_, HandlerError>(()) })
            .on_message("Boom", |_: &Message| async {
                Err::<(), _>(HandlerError::from("boom"))
            })
            .on_message("Later", |_: &Message| async {
                Err::<(), HandlerError>(TemporarilyUnavailable::new("warehouse answers 503").into())
            });
        let relay = Relay::builder(store.clone())
            .name(OUTBOX)
            .clock(clock.clone())
            .dispatcher(handlers)
            .transport(transport)
            .max_attempts(2)
            .retry_policy(RetryPolicy::NextRound)
            .probe_initial(Duration::from_millis(10))
            .probe_max(Duration::from_millis(20))
            .build()
            .unwrap();

        let mut tx = store.begin();
        for message in [
            domain("Ok"),
            domain("Ok"),
            domain("Boom"),
            domain("Later"),
            integration("Shipped"),
            integration("Refused"),
        ] {
            tx.enqueue(message).unwrap();
        }
        tx.commit().unwrap();

        // Round 1, 3 s after the commit: two Ok and one Shipped delivered;
        // Boom fails and Refused is rejected (attempt 1 of 2); Later is
        // given back uncounted.
        clock.advance(Duration::from_secs(3));
        let r = relay.drain().await.unwrap();
        assert_eq!((r.delivered, r.failed, r.deferred), (3, 2, 1), "{r:?}");
        // Round 2: Boom and Refused fail again and are poisoned; Later is
        // given back again.
        clock.advance(Duration::from_secs(10));
        let r = relay.drain().await.unwrap();
        assert_eq!((r.poisoned, r.deferred), (2, 1), "{r:?}");
        // Round 3: the broker is down: a second Shipped is given back
        // uncounted (an outage) and the transport paused.
        broker.set_down("broker gone");
        let mut tx = store.begin();
        tx.enqueue(integration("Shipped")).unwrap();
        tx.commit().unwrap();
        clock.advance(Duration::from_secs(10));
        relay.drain().await.unwrap();
        // The gauges are read by health() (and by a task of the spawned relay).
        let health = relay.health().await;
        assert_eq!((health.pending, health.poisoned), (2, 2), "{health:?}");

        let c = |name, labels: &[(&str, &str)]| rec.counter(name, labels);
        assert_eq!(c(m::DELIVERED, &of("domain", "Ok")), 2);
        assert_eq!(c(m::DELIVERED, &of("integration", "Shipped")), 1);
        assert_eq!(c(m::FAILED, &of("domain", "Ok")), 0);
        assert_eq!(c(m::FAILED, &of("domain", "Boom")), 2);
        assert_eq!(c(m::FAILED, &of("integration", "Refused")), 2);
        assert_eq!(c(m::REJECTED, &of("integration", "Refused")), 2);
        assert_eq!(c(m::REJECTED, &of("integration", "Shipped")), 0);
        // What cannot happen to a kind is not registered for it.
        assert_eq!(rec.try_counter(m::REJECTED, &of("domain", "Boom")), None);
        assert_eq!(c(m::POISONED, &of("domain", "Boom")), 1);
        assert_eq!(c(m::POISONED, &of("integration", "Refused")), 1);
        assert_eq!(c(m::DELIVERED, &of("domain", "Boom")), 0);
        let outage = [(m::RELEASE_REASON, "outage")];
        let unavailable = [(m::RELEASE_REASON, "handler_unavailable")];
        assert_eq!(
            c(m::RELEASED, &with(of("integration", "Shipped"), &outage)),
            1
        );
        assert_eq!(
            c(m::RELEASED, &with(of("domain", "Later"), &unavailable)),
            3
        );
        assert_eq!(
            rec.try_counter(m::RELEASED, &with(of("domain", "Later"), &outage)),
            None
        );
        assert_eq!(c(m::DELIVERED, &of("domain", "Later")), 0);

        // Commit → delivered: every delivery came 3 s after its commit.
        let lag = |kind, ty| rec.histogram(m::DELIVERY_LAG, &of(kind, ty));
        assert_eq!(lag("domain", "Ok"), vec![3.0, 3.0]);
        assert_eq!(lag("integration", "Shipped"), vec![3.0]);
        assert_eq!(lag("domain", "Boom"), Vec::<f64>::new());
        // One duration per handler run or send, whatever its outcome: Shipped
        // and Refused went out in one send in round 1, then each alone.
        let process = [
            (m::OPERATION_NAME, "process"),
            (m::OPERATION_TYPE, "process"),
        ];
        let send = [(m::OPERATION_NAME, "send"), (m::OPERATION_TYPE, "send")];
        let durations = |name, kind, ty, op: &[(&'static str, &'static str)]| {
            rec.histogram(name, &with(of(kind, ty), op))
        };
        for (ty, n) in [("Ok", 2), ("Boom", 2), ("Later", 3)] {
            let d = durations(m::PROCESS_DURATION, "domain", ty, &process);
            assert_eq!(d.len(), n, "{ty}: {d:?}");
            assert!(d.iter().all(|s| (0.0..30.0).contains(s)), "{ty}: {d:?}");
        }
        for (ty, n) in [("Shipped", 2), ("Refused", 2)] {
            let d = durations(m::OPERATION_DURATION, "integration", ty, &send);
            assert_eq!(d.len(), n, "{ty}: {d:?}");
            assert!(d.iter().all(|s| (0.0..30.0).contains(s)), "{ty}: {d:?}");
        }
        // Claims: 6 messages, then Boom, Refused and Later, then Later and
        // the second Shipped; empty claims end each drain.
        let claims = rec.histogram(m::CLAIM_SIZE, &[(m::OUTBOX, OUTBOX)]);
        assert_eq!(claims.iter().sum::<f64>(), 11.0, "{claims:?}");
        assert_eq!(
            claims.iter().copied().fold(0.0, f64::max),
            6.0,
            "{claims:?}"
        );
        assert!(claims.contains(&0.0), "{claims:?}");

        let g = |name| rec.gauge(name, &[(m::OUTBOX, OUTBOX)]);
        assert_eq!(g(m::PENDING), 2.0);
        assert_eq!(g(m::POISONED_NOW), 2.0);
        // Later, committed at t0, is the oldest pending: 23 s old.
        assert_eq!(g(m::OLDEST_PENDING_AGE), 23.0);
        assert_eq!(g(m::TRANSPORT_UP), 0.0);

        // The broker comes back; the probe reopens the transport.
        broker.set_up();
        relay.drain().await.unwrap();
        wait_until("outbox.transport.up = 1", DEADLINE, || async {
            g(m::TRANSPORT_UP) == 1.0
        })
        .await;
    });
}

#[test]
fn a_running_relay_reads_the_backlog_gauges_by_itself() {
    let rec = TestRecorder::new();
    rec.block_on(async {
        let (clock, store) = store_on_a_manual_clock();
        let mut tx = store.begin();
        for _ in 0..3 {
            tx.enqueue(domain("Waiting")).unwrap();
        }
        tx.commit().unwrap();
        clock.advance(Duration::from_secs(5));
        // Only a transport: the domain messages stay pending.
        let (transport, _broker) = MemoryTransport::new();
        let handle = Relay::builder(store.clone())
            .name("billing")
            .clock(clock.clone())
            .transport(transport)
            .metrics_interval(Some(Duration::from_millis(20)))
            .spawn()
            .unwrap();
        let billing = [(m::OUTBOX, "billing")];
        // Registered at build, before anything was read.
        assert_eq!(rec.gauge(m::PENDING, &billing), 0.0);
        wait_until("the backlog gauges", DEADLINE, || async {
            rec.gauge(m::PENDING, &billing) == 3.0
                && rec.gauge(m::OLDEST_PENDING_AGE, &billing) == 5.0
        })
        .await;
        assert_eq!(rec.gauge(m::POISONED_NOW, &billing), 0.0);
        assert_eq!(rec.gauge(m::TRANSPORT_UP, &billing), 1.0);
        // Settled again as the clock moves: the task keeps reading.
        clock.advance(Duration::from_secs(5));
        wait_until("the age to follow the clock", DEADLINE, || async {
            rec.gauge(m::OLDEST_PENDING_AGE, &billing) == 10.0
        })
        .await;
        handle.shutdown().await;
    });
}

#[test]
fn a_fleet_labels_by_outbox_and_kind_so_its_series_grow_with_its_outboxes_only() {
    let rec = TestRecorder::new();
    rec.block_on(async {
        let fleet = outbox::Fleet::builder()
            .worker_id("metrics-fleet")
            .build()
            .unwrap();
        let types = ["A", "B", "C"];
        let mut stores = Vec::new();
        for tenant in ["tenant-1", "tenant-2"] {
            let store = MemoryStore::new();
            let mut tx = store.begin();
            for ty in types {
                tx.enqueue(domain(ty)).unwrap();
                tx.enqueue(domain(ty)).unwrap();
            }
            tx.commit().unwrap();
            let mut handlers = Handlers::new();
            for ty in types {
                handlers =
                    handlers.on_message(ty, |_: &Message| async { Ok::<_, HandlerError>(()) });
            }
            fleet
                .add(tenant, Relay::builder(store.clone()).dispatcher(handlers))
                .unwrap();
            stores.push(store);
        }
        fleet.until_idle().await.unwrap();
        for tenant in ["tenant-1", "tenant-2"] {
            // One series for the kind, every type counted in it.
            let labels = [(m::OUTBOX, tenant), (m::MESSAGE_KIND, "domain")];
            assert_eq!(rec.counter(m::DELIVERED, &labels), 6, "{tenant}");
            assert_eq!(rec.histogram(m::DELIVERY_LAG, &labels).len(), 6, "{tenant}");
            for ty in types {
                assert_eq!(
                    rec.try_counter(m::DELIVERED, &with(of("domain", ty), &[])),
                    None,
                    "no per-type series in a fleet by default"
                );
            }
        }
        let delivered = rec
            .keys()
            .into_iter()
            .filter(|k| k.starts_with(&format!("counter Key({},", m::DELIVERED)))
            .count();
        assert_eq!(delivered, 2, "one series an outbox: {:#?}", rec.keys());
        fleet.shutdown().await;
    });
}

#[test]
fn a_fleet_can_keep_the_type_label() {
    let rec = TestRecorder::new();
    rec.block_on(async {
        let fleet = outbox::Fleet::builder()
            .worker_id("metrics-fleet-typed")
            .metric_labels(m::MetricLabels::OutboxAndType)
            .build()
            .unwrap();
        let store = MemoryStore::new();
        let mut tx = store.begin();
        tx.enqueue(domain("A")).unwrap();
        tx.enqueue(domain("B")).unwrap();
        tx.commit().unwrap();
        let handlers = Handlers::new()
            .on_message("A", |_: &Message| async { Ok::<_, HandlerError>(()) })
            .on_message("B", |_: &Message| async { Ok::<_, HandlerError>(()) });
        fleet
            .add(OUTBOX, Relay::builder(store.clone()).dispatcher(handlers))
            .unwrap();
        fleet.until_idle().await.unwrap();
        assert_eq!(rec.counter(m::DELIVERED, &of("domain", "A")), 1);
        assert_eq!(rec.counter(m::DELIVERED, &of("domain", "B")), 1);
        fleet.shutdown().await;
    });
}
