//! A fleet of outboxes in one relay process (rule "Fleets" in
//! `docs/rules.md`): the fleet's slots go round the outboxes with work, an
//! outbox whose handler is down holds back only its own messages, and
//! outboxes join and leave while it runs. (Every relay rule for an outbox
//! inside a fleet: `relay_memory`, `relay_sqlite`, `relay_postgres`, in
//! their `in_a_fleet` modules.)

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::memory::MemoryStore;
use outbox::{
    Catalogue, ErrorKind, Fleet, Handlers, HealthStatus, Message, MessageKind, NewMessage, Relay,
    TemporarilyUnavailable,
};
use outbox_api::testing::wait_until;

const DEADLINE: Duration = Duration::from_secs(30);

fn msg(t: &str, n: usize) -> NewMessage {
    NewMessage::new(MessageKind::Domain, t, n.to_string().into_bytes())
}

fn store_with(t: &str, n: usize) -> MemoryStore {
    let store = MemoryStore::new();
    let mut tx = store.begin();
    for i in 0..n {
        tx.enqueue(msg(t, i)).unwrap();
    }
    tx.commit().unwrap();
    store
}

fn fleet(slots: usize, name: &str) -> Fleet {
    // A worker id of this test's own: live ids are refused process-wide.
    Fleet::builder()
        .concurrency(slots)
        .worker_id(format!("fleet-test-{name}"))
        .build()
        .unwrap()
}

/// Counts deliveries, each taking `each`.
fn counting(t: &'static str, count: &Arc<AtomicUsize>, each: Duration) -> Handlers {
    let count = count.clone();
    Handlers::new().on_message(t, move |_: &Message| {
        count.fetch_add(1, Ordering::SeqCst);
        async move {
            tokio::time::sleep(each).await;
            Ok::<_, std::io::Error>(())
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_backlog_delays_a_fresh_message_of_another_outbox_by_a_few_deliveries() {
    let fleet = fleet(2, "backlog");
    let hot_started = Arc::new(AtomicUsize::new(0));
    // The hot outbox alone could fill every slot of the fleet many times over.
    fleet
        .add(
            "hot",
            Relay::builder(store_with("Hot", 20_000))
                .dispatcher(counting("Hot", &hot_started, Duration::from_millis(5)))
                .concurrency(64)
                .batch_size(100),
        )
        .unwrap();
    let quiet = MemoryStore::new();
    // How many hot deliveries had started when the quiet one started.
    let seen: Arc<Mutex<Vec<usize>>> = Arc::default();
    let (s, hot) = (seen.clone(), hot_started.clone());
    fleet
        .add(
            "quiet",
            Relay::builder(quiet.clone()).dispatcher(Handlers::new().on_message(
                "Quiet",
                move |_: &Message| {
                    s.lock().unwrap().push(hot.load(Ordering::SeqCst));
                    async { Ok::<_, std::io::Error>(()) }
                },
            )),
        )
        .unwrap();
    wait_until("the hot outbox fills the fleet's slots", DEADLINE, || {
        let (n, busy) = (hot_started.load(Ordering::SeqCst), fleet.in_flight());
        async move { n > 50 && busy == 2 }
    })
    .await;
    let mut gaps = Vec::new();
    for i in 0..20 {
        let before = hot_started.load(Ordering::SeqCst);
        let mut tx = quiet.begin();
        tx.enqueue(msg("Quiet", i)).unwrap();
        tx.commit().unwrap();
        wait_until("the quiet outbox's message is delivered", DEADLINE, || {
            let done = seen.lock().unwrap().len() > i;
            async move { done }
        })
        .await;
        gaps.push(seen.lock().unwrap()[i] - before);
    }
    let hot_left = 20_000 - hot_started.load(Ordering::SeqCst);
    assert!(hot_left > 0, "the hot outbox's backlog outlasted the test");
    // The quiet message waits for the slot a hot delivery frees, behind at
    // most the hot outbox's one place in the queue: a few hot deliveries
    // (those started while its relay claimed it), never the backlog's
    // thousands.
    let worst = *gaps.iter().max().unwrap();
    eprintln!("hot deliveries started before each quiet one: {gaps:?}");
    assert!(
        worst <= 6,
        "a fresh message waited behind {worst} deliveries of the hot outbox (each: {gaps:?})"
    );
    fleet.shutdown().await;
}

/// Deliveries each of two busy outboxes starts while the fleet starts
/// `total` more, from now.
async fn shares(counts: [&Arc<AtomicUsize>; 2], total: usize) -> [usize; 2] {
    let before = counts.map(|c| c.load(Ordering::SeqCst));
    let started = || {
        let now = counts.map(|c| c.load(Ordering::SeqCst));
        [now[0] - before[0], now[1] - before[1]]
    };
    wait_until("the fleet delivers", DEADLINE, || {
        let [a, b] = started();
        async move { a + b >= total }
    })
    .await;
    started()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavier_outbox_gets_its_weight_in_slots_and_a_new_weight_holds_from_its_next_turn() {
    let fleet = fleet(4, "weights");
    let (heavy, light) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let busy = |t: &'static str, count: &Arc<AtomicUsize>| {
        Relay::builder(store_with(t, 20_000))
            .dispatcher(counting(t, count, Duration::from_millis(2)))
            .concurrency(64)
            .batch_size(200)
    };
    fleet
        .add("heavy", busy("Heavy", &heavy).fleet_weight(3))
        .unwrap();
    fleet.add("light", busy("Light", &light)).unwrap();
    assert_eq!(
        (fleet.weight("heavy"), fleet.weight("light")),
        (Some(3), Some(1))
    );
    // Past the start, where the first to claim takes every free slot.
    shares([&heavy, &light], 100).await;
    let [h, l] = shares([&heavy, &light], 800).await;
    eprintln!("weights 3 and 1: {h} and {l} deliveries");
    assert!(
        (2 * l..=5 * l).contains(&h),
        "with weights 3 and 1 the heavy outbox should start about three deliveries for each of the light one's; it started {h} against {l}"
    );
    fleet.set_weight("heavy", 1).unwrap();
    assert_eq!(fleet.weight("heavy"), Some(1));
    shares([&heavy, &light], 100).await;
    let [h, l] = shares([&heavy, &light], 800).await;
    eprintln!("weights 1 and 1: {h} and {l} deliveries");
    assert!(
        (l / 2..=l * 3 / 2).contains(&h),
        "with equal weights both outboxes should start about as many deliveries; they started {h} and {l}"
    );
    assert!(
        heavy.load(Ordering::SeqCst) < 20_000 && light.load(Ordering::SeqCst) < 20_000,
        "a backlog ran out before the test ended"
    );
    let e = fleet.set_weight("heavy", 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("heavy"), "{e}");
    let e = fleet.set_weight("nobody", 2).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert_eq!(
        fleet.weight("heavy"),
        Some(1),
        "a refused weight changes nothing"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_whose_handler_is_down_holds_back_only_its_own_messages() {
    let fleet = fleet(2, "down");
    let tried = Arc::new(AtomicUsize::new(0));
    let t = tried.clone();
    fleet
        .add(
            "down",
            Relay::builder(store_with("Pay", 1_000))
                .dispatcher(Handlers::new().on_message("Pay", move |_: &Message| {
                    t.fetch_add(1, Ordering::SeqCst);
                    async {
                        Err::<(), _>(TemporarilyUnavailable::new(
                            "the payment service answers 503",
                        ))
                    }
                }))
                .concurrency(64),
        )
        .unwrap();
    // A handler that hangs holds at most its outbox's own limit of slots.
    fleet
        .add(
            "hanging",
            Relay::builder(store_with("Hang", 100))
                .dispatcher(counting("Hang", &Arc::default(), Duration::from_secs(3600)))
                .concurrency(1),
        )
        .unwrap();
    let delivered = Arc::new(AtomicUsize::new(0));
    let up = store_with("Ship", 300);
    fleet
        .add(
            "up",
            Relay::builder(up.clone()).dispatcher(counting(
                "Ship",
                &delivered,
                Duration::from_millis(1),
            )),
        )
        .unwrap();
    wait_until("the healthy outbox delivers all it has", DEADLINE, || {
        let up = up.clone();
        async move { outbox::Store::stats(&up).await.unwrap().pending == 0 }
    })
    .await;
    assert_eq!(delivered.load(Ordering::SeqCst), 300, "each once");
    assert!(
        tried.load(Ordering::SeqCst) > 0,
        "the down outbox was tried"
    );
    let health = fleet.health().await;
    assert_eq!(health.status, HealthStatus::Degraded, "{health:?}");
    assert_eq!(health.not_healthy(), vec!["down"], "{health:?}");
    assert_eq!(health.outboxes["up"].pending, 0);
    assert_eq!(
        health.outboxes["down"].pending, 1_000,
        "nothing of it is lost"
    );
    // Dropped, not shut down: a shutdown would wait for the hanging
    // handler's timeout.
    drop(fleet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outboxes_join_and_leave_while_the_fleet_runs() {
    let fleet = fleet(4, "membership");
    let delivered = Arc::new(AtomicUsize::new(0));
    let relay = |store: &MemoryStore| {
        Relay::builder(store.clone()).dispatcher(counting("T", &delivered, Duration::ZERO))
    };
    let stores: Vec<MemoryStore> = (0..3).map(|_| store_with("T", 10)).collect();
    for (i, store) in stores.iter().enumerate() {
        let handle = fleet.add(format!("tenant-{i}"), relay(store)).unwrap();
        assert_eq!(
            handle.relay().config().worker_id,
            format!("fleet-test-membership/tenant-{i}")
        );
        let config = handle.relay().config();
        assert_eq!(config.name, format!("tenant-{i}"));
        // Its poll is the fleet's sweep, spread between ¾ and 1¼ of it.
        let poll = config.poll_interval.as_secs_f64();
        assert!((22.5..=37.5).contains(&poll), "{poll}");
        assert!(config.purge_interval >= outbox::DEFAULT_SWEEP);
    }
    assert_eq!(fleet.outboxes(), ["tenant-0", "tenant-1", "tenant-2"]);
    fleet.until_idle().await.unwrap();
    assert_eq!(delivered.load(Ordering::SeqCst), 30);

    // A name twice, a bad name, an unknown name: refused, nothing changed.
    let e = fleet.add("tenant-1", relay(&stores[1])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
    assert!(e.to_string().contains("tenant-1"), "{e}");
    for bad in ["", "two words", "tab\there"] {
        let e = fleet.add(bad, relay(&stores[0])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{bad:?}: {e}");
    }
    let e = fleet.remove("tenant-9").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert_eq!(fleet.len(), 3);

    // A tenant leaves: its messages wait in its store, untouched.
    fleet.remove("tenant-1").await.unwrap();
    assert_eq!(fleet.outboxes(), ["tenant-0", "tenant-2"]);
    let mut tx = stores[1].begin();
    for i in 0..5 {
        tx.enqueue(msg("T", i)).unwrap();
    }
    tx.commit().unwrap();
    fleet.until_idle().await.unwrap();
    assert_eq!(
        delivered.load(Ordering::SeqCst),
        30,
        "a removed outbox is not relayed"
    );
    assert_eq!(outbox::Store::stats(&stores[1]).await.unwrap().pending, 5);
    // It joins again under the same name (and worker id) and catches up.
    fleet.add("tenant-1", relay(&stores[1])).unwrap();
    fleet.until_idle().await.unwrap();
    assert_eq!(delivered.load(Ordering::SeqCst), 35);
    assert_eq!(
        fleet.totals().delivered,
        35 - 10,
        "totals of the members now"
    );
    assert_eq!(fleet.health().await.status, HealthStatus::Healthy);

    fleet.shutdown().await;
    assert!(fleet.is_empty());
}

/// A register of tenants for `Fleet::discover`: its reads can be made to
/// fail, and the relays of the names in `refused` cannot be built.
#[derive(Default)]
struct Register {
    stores: Mutex<BTreeMap<String, MemoryStore>>,
    refused: Mutex<BTreeSet<String>>,
    reads_fail: AtomicBool,
    delivered: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl Catalogue for Register {
    async fn outboxes(&self) -> outbox::Result<BTreeSet<String>> {
        if self.reads_fail.load(Ordering::SeqCst) {
            return Err(outbox::Error::new(
                ErrorKind::Unavailable,
                "the register is down",
            ));
        }
        Ok(self.stores.lock().unwrap().keys().cloned().collect())
    }

    async fn relay(&self, name: &str) -> outbox::Result<outbox::RelayBuilder> {
        if self.refused.lock().unwrap().contains(name) {
            return Err(outbox::Error::new(
                ErrorKind::Unavailable,
                format!("no store for `{name}` yet"),
            ));
        }
        let store = self.stores.lock().unwrap()[name].clone();
        Ok(Relay::builder(store).dispatcher(counting("T", &self.delivered, Duration::ZERO)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_follows_a_catalogue_adding_and_removing_only_what_it_names() {
    let register = Arc::new(Register::default());
    let add = |name: &str, n: usize| {
        let store = store_with("T", n);
        register.stores.lock().unwrap().insert(name.into(), store);
    };
    add("a", 3);
    add("b", 4);
    let fleet = fleet(4, "discovery");
    let discovery = fleet
        .discover(Arc::clone(&register), Duration::from_secs(3600))
        .unwrap();
    // The first reading is at once, not after the interval.
    wait_until(
        "the catalogue's outboxes are added and drained",
        DEADLINE,
        || async {
            fleet.outboxes() == ["a", "b"] && register.delivered.load(Ordering::SeqCst) == 7
        },
    )
    .await;

    // An outbox added by hand is not the catalogue's: never removed by it.
    fleet
        .add(
            "by-hand",
            Relay::builder(store_with("T", 1)).dispatcher(counting(
                "T",
                &register.delivered,
                Duration::ZERO,
            )),
        )
        .unwrap();
    // A new tenant, and one whose relay cannot be built yet.
    add("c", 2);
    add("d", 5);
    register.refused.lock().unwrap().insert("d".into());
    let report = discovery.refresh().await.unwrap();
    assert_eq!(report.added, ["c"]);
    assert!(report.removed.is_empty(), "{report:?}");
    assert_eq!(report.failed.len(), 1, "{report:?}");
    assert_eq!(report.failed[0].0, "d");
    assert!(
        report.failed[0].1.to_string().contains("no store for `d`"),
        "{report:?}"
    );
    assert_eq!(fleet.outboxes(), ["a", "b", "by-hand", "c"]);

    // A failed read changes nothing, even though `a` has left meanwhile.
    register.stores.lock().unwrap().remove("a");
    register.reads_fail.store(true, Ordering::SeqCst);
    let e = discovery.refresh().await.unwrap_err();
    assert!(e.to_string().contains("the register is down"), "{e}");
    assert_eq!(fleet.outboxes(), ["a", "b", "by-hand", "c"]);

    // The next good read removes `a`, adds `d` now that it can be built,
    // and leaves `by-hand` alone.
    register.reads_fail.store(false, Ordering::SeqCst);
    register.refused.lock().unwrap().clear();
    let report = discovery.refresh().await.unwrap();
    assert_eq!(
        (report.added.as_slice(), report.removed.as_slice()),
        (&["d".to_string()][..], &["a".to_string()][..])
    );
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(fleet.outboxes(), ["b", "by-hand", "c", "d"]);
    fleet.until_idle().await.unwrap();
    assert_eq!(register.delivered.load(Ordering::SeqCst), 3 + 4 + 1 + 2 + 5);

    // Removed by hand while the catalogue still names it: back at the next
    // reading; a reading with no change reports none.
    fleet.remove("c").await.unwrap();
    let report = discovery.refresh().await.unwrap();
    assert_eq!(report.added, ["c"]);
    let report = discovery.refresh().await.unwrap();
    assert!(
        report.added.is_empty() && report.removed.is_empty() && report.failed.is_empty(),
        "{report:?}"
    );

    // The discovery does not keep its fleet alive: it ends with it.
    drop(fleet);
    let e = discovery.refresh().await.unwrap_err();
    assert!(e.to_string().contains("its fleet is gone"), "{e}");
}

#[test]
fn a_discovery_refuses_a_zero_interval() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _entered = runtime.enter();
    let e = fleet(1, "discovery-zero")
        .discover(Arc::new(Register::default()), Duration::ZERO)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("discover every"), "{e}");
}

#[test]
fn a_fleet_refuses_a_bad_configuration() {
    let e = Fleet::builder().concurrency(0).build().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("concurrency"), "{e}");
    let e = Fleet::builder().worker_id(" ").build().unwrap_err();
    assert!(e.to_string().contains("worker_id"), "{e}");
    let e = Fleet::builder()
        .sweep_interval(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("sweep_interval"), "{e}");
    let e = Relay::builder(MemoryStore::new())
        .fleet_weight(0)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("fleet_weight"), "{e}");
}

/// The database files under `dir` this process has open now (by its file
/// descriptors; a connection also opens the WAL and its index, not counted).
fn open_db_files(dir: &std::path::Path) -> usize {
    let mut files = std::collections::BTreeSet::new();
    for fd in std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(target) = std::fs::read_link(fd.path())
            && target.starts_with(dir)
            && target.extension().is_some_and(|e| e == "db")
        {
            files.insert(target);
        }
    }
    files.len()
}

/// Enqueues `n` messages of type `t` into `store`'s file on an application
/// connection of its own, closed afterwards.
async fn enqueue_sqlite(store: &outbox_sqlite::SqliteStore, t: &str, n: usize) {
    use outbox_sqlite::sqlx;
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(store.path());
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    for i in 0..n {
        store.outbox().enqueue(&mut *tx, msg(t, i)).await.unwrap();
    }
    tx.commit().await.unwrap();
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_sqlite_files_keeps_at_most_the_bound_open_and_closes_idle_ones() {
    use outbox_sqlite::{SqliteFiles, SqliteStore};
    let dir = tempfile::tempdir().unwrap();
    let files = SqliteFiles::new(3, Duration::from_millis(300)).unwrap();
    // A sweep far beyond the deadline: every delivery below comes from a
    // claim at the start or a wake-up by an in-process commit.
    let fleet = Fleet::builder()
        .concurrency(8)
        .worker_id("fleet-test-sqlite-files")
        .sweep_interval(Duration::from_secs(3600))
        .build()
        .unwrap();
    let (tenants, each) = (12, 25);
    let delivered = Arc::new(AtomicUsize::new(0));
    let mut stores = Vec::new();
    for i in 0..tenants {
        let store = SqliteStore::builder(dir.path().join(format!("tenant-{i}.db")))
            .open_through(&files)
            .connect()
            .await
            .unwrap();
        store.migrate().await.unwrap();
        enqueue_sqlite(&store, "Work", each).await;
        stores.push(store);
    }
    assert!(files.open() <= 3, "{} open", files.open());
    for (i, store) in stores.iter().enumerate() {
        fleet
            .add(
                format!("tenant-{i}"),
                Relay::builder(store.clone()).dispatcher(counting(
                    "Work",
                    &delivered,
                    Duration::from_millis(1),
                )),
            )
            .unwrap();
    }
    // Watched while the fleet drains: never more than the bound open.
    let mut most = 0;
    let deadline = std::time::Instant::now() + DEADLINE;
    while delivered.load(Ordering::SeqCst) < tenants * each {
        assert!(std::time::Instant::now() < deadline, "not all delivered");
        most = most.max(open_db_files(dir.path())).max(files.open());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(most <= 3, "{most} files open at once, the bound is 3");
    assert!(most >= 1, "the watch saw no file open at all");
    fleet.until_idle().await.unwrap();
    // Idle: every file closed.
    wait_until("every idle file closed", DEADLINE, || async {
        files.open() == 0 && open_db_files(dir.path()) == 0
    })
    .await;
    // A commit in this process wakes its tenant's relay, which opens its
    // file again (no sweep will come).
    enqueue_sqlite(&stores[5], "Work", 3).await;
    wait_until(
        "the woken tenant's messages delivered",
        DEADLINE,
        || async { delivered.load(Ordering::SeqCst) == tenants * each + 3 },
    )
    .await;
    // Handled is not yet completed: wait for the completions to commit.
    wait_until("every delivery completed", DEADLINE, || async {
        use outbox::Store as _;
        let mut pending = 0;
        for store in &stores {
            pending += store.stats().await.unwrap().pending;
        }
        pending == 0
    })
    .await;
    for store in &stores {
        use outbox::Store as _;
        let stats = store.stats().await.unwrap();
        assert_eq!(stats.pending, 0, "{store:?}");
    }
    fleet.shutdown().await;
}

#[test]
fn sqlite_files_refuse_a_zero_bound_or_idle_time() {
    let e = outbox_sqlite::SqliteFiles::new(0, Duration::from_secs(1)).unwrap_err();
    assert!(e.to_string().contains("max_open"), "{e}");
    let e = outbox_sqlite::SqliteFiles::new(4, Duration::ZERO).unwrap_err();
    assert!(e.to_string().contains("idle"), "{e}");
}
