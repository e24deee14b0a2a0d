//! One `LISTEN` connection for the outboxes of many schemas of a database
//! (`PgSharedListener`, rule "Fleets" in `docs/rules.md`): each outbox
//! hears its own table's channel only; the connection comes back after it
//! is ended, telling every outbox to catch up.

use std::str::FromStr;
use std::time::Duration;

use outbox_api::testing::wait_until;
use outbox_api::{ErrorKind, Store, WorkListener};
use outbox_api::{MessageKind, NewMessage};
use outbox_postgres::sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use outbox_postgres::sqlx::{self, PgPool};
use outbox_postgres::testing::{PgUnderTest, commit_one, database_url, listens};
use outbox_postgres::{PgSharedListener, PgStore, WakeUp};

const DEADLINE: Duration = Duration::from_secs(20);

/// A pool whose connections (and so the shared listener's) carry `name`.
async fn named_pool(name: &str) -> PgPool {
    let options = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .application_name(name);
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .expect("connect to PostgreSQL")
}

/// Another process's commit to `f`'s table: a store of its own, so no
/// in-process wake-up reaches the listeners, only `NOTIFY`. The store is
/// returned: it announces the commit after it, from a task of its own.
async fn commit_elsewhere(f: &PgUnderTest) -> PgStore {
    let other = f.second_store(1).await;
    // On the second store's pool: `f`'s may belong to a runtime gone.
    commit_one(&other).await;
    other
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outboxes_of_many_schemas_share_one_listen_connection_and_a_commit_wakes_only_its_own() {
    let name = format!("shared-listener-{}", std::process::id());
    let pool = named_pool(&name).await;
    let shared = PgSharedListener::new(&pool);
    let mut fixtures = Vec::new();
    for _ in 0..3 {
        fixtures.push(
            PgUnderTest::fresh_with(None, |b| {
                b.listen_through(&shared)
                    .poll_interval(Duration::from_secs(3600))
            })
            .await,
        );
    }
    let mut listeners: Vec<Box<dyn WorkListener>> =
        fixtures.iter().map(|f| f.pg().listen()).collect();
    // Each channel newly listened to reports a change (a catch-up claim).
    for l in &mut listeners {
        assert!(l.wait(DEADLINE).await, "a first catch-up report");
    }
    assert_eq!(shared.channels(), 3);
    // One LISTEN connection for the three.
    listens(&pool, &name).await;
    assert!(shared.is_listening());
    for l in &mut listeners {
        while l.wait(Duration::from_millis(50)).await {}
    }

    let _announcing = commit_elsewhere(&fixtures[1]).await;
    assert!(
        listeners[1].wait(DEADLINE).await,
        "a commit to its table wakes its listener (its poll is an hour)"
    );
    // The notification for table 1 has been handed out by the task that
    // hands out every notification of the connection, in order: none came
    // for the others.
    for i in [0, 2] {
        assert!(
            !listeners[i].wait(Duration::ZERO).await,
            "a commit to another schema's table woke listener {i}"
        );
    }

    // A listener dropped gives its channel up.
    drop(listeners.pop());
    wait_until(
        "the dropped listener's channel is given up",
        DEADLINE,
        || {
            let n = shared.channels();
            async move { n == 2 }
        },
    )
    .await;

    // The connection is ended: every listener is told at once, and again
    // when it is back (to catch up on what was sent meanwhile).
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = $1 AND (query LIKE 'LISTEN%' OR query LIKE 'UNLISTEN%')",
    )
    .bind(&name)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(ended, 1);
    for l in &mut listeners {
        assert!(l.wait(DEADLINE).await, "told of the lost connection");
    }
    listens(&pool, &name).await;
    wait_until("the shared connection listens again", DEADLINE, || {
        let up = shared.is_listening();
        async move { up }
    })
    .await;
    for l in &mut listeners {
        while l.wait(Duration::from_millis(50)).await {}
    }
    let _announcing = commit_elsewhere(&fixtures[0]).await;
    assert!(
        listeners[0].wait(DEADLINE).await,
        "woken after the reconnect"
    );
    assert!(!listeners[1].wait(Duration::ZERO).await);
}

/// The stores built with one shared listener share one commit watcher
/// too, on a connection of its own opened with the listener's options:
/// a commit into one store, and one transaction that enqueued into two
/// others, are announced to other processes with a `NOTIFY` on each
/// table's channel, sent from that connection, whose last statement was
/// the watcher's look. (With a watcher per store, the looks and the
/// notifications came from the stores' own pools.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stores_of_one_shared_listener_share_one_commit_watcher() {
    let name = format!("shared-watcher-{}", std::process::id());
    let pool = named_pool(&name).await;
    let shared = PgSharedListener::new(&pool);
    let mut fixtures = Vec::new();
    for _ in 0..3 {
        fixtures.push(PgUnderTest::fresh_with(None, |b| b.listen_through(&shared)).await);
    }
    let mut raw = PgListener::connect(&database_url()).await.unwrap();
    for f in &fixtures {
        raw.listen(&f.pg().channel()).await.unwrap();
    }
    // Each notification heard within the deadline: its channel and the
    // server process that sent it.
    async fn heard(raw: &mut PgListener, n: usize) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        while out.len() < n {
            let note = tokio::time::timeout(DEADLINE, raw.recv())
                .await
                .expect("a commit is announced within the deadline")
                .unwrap();
            out.push((note.channel().to_owned(), note.process_id()));
        }
        out
    }
    commit_one(fixtures[0].pg()).await;
    let mut notes = heard(&mut raw, 1).await;
    assert_eq!(notes[0].0, fixtures[0].pg().channel());

    let mut tx = fixtures[1].pool().begin().await.unwrap();
    for f in &fixtures[1..] {
        let m = NewMessage::new(MessageKind::Domain, "T", b"x".to_vec());
        f.pg().outbox().enqueue(&mut tx, m).await.unwrap();
    }
    tx.commit().await.unwrap();
    let mut two = heard(&mut raw, 2).await;
    two.sort();
    let mut want = vec![fixtures[1].pg().channel(), fixtures[2].pg().channel()];
    want.sort();
    assert_eq!(two.iter().map(|(c, _)| c.clone()).collect::<Vec<_>>(), want);
    notes.extend(two);

    let watchers: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE '%pg_xact_status%' \
           AND pid <> pg_backend_pid()",
    )
    .bind(&name)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        watchers.len(),
        1,
        "one connection of the shared listener's options looks at the transactions"
    );
    for (channel, pid) in notes {
        assert_eq!(
            pid as i32, watchers[0],
            "the notification on {channel} came from the shared watcher's connection"
        );
    }
}

/// A store of the current runtime on `fixture`'s table, through `shared`
/// (a fixture's own pools belong to the runtime it was made on); its poll
/// is an hour, so only a notification wakes its relays in time.
async fn store_of_this_runtime(fixture: &PgUnderTest, shared: &PgSharedListener) -> PgStore {
    PgStore::builder(fixture.url())
        .schema(fixture.schema())
        .table("test_outbox")
        .inbox_table("test_inbox")
        .max_connections(1)
        .listen_through(shared)
        .poll_interval(Duration::from_secs(3600))
        .connect()
        .await
        .unwrap()
}

/// The shared listener's task runs on the runtime of the first relay that
/// listened. When that runtime shuts down (an application that set its
/// first relays up on a runtime it then dropped), the relays of a later
/// runtime start it again instead of only polling.
#[test]
fn a_listener_whose_runtime_shut_down_starts_again_for_the_next_one() {
    let name = format!("shared-listener-rt-{}", std::process::id());
    let first = tokio::runtime::Runtime::new().unwrap();
    let (shared, fixture) = first.block_on(async {
        let pool = named_pool(&name).await;
        let shared = PgSharedListener::new(&pool);
        let fixture = PgUnderTest::fresh_with(None, |b| {
            b.listen_through(&shared)
                .poll_interval(Duration::from_secs(3600))
        })
        .await;
        let mut listener = fixture.pg().listen();
        assert!(listener.wait(DEADLINE).await, "a first catch-up report");
        listens(&pool, &name).await;
        (shared, fixture)
    });
    drop(first);

    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        // A store of this runtime on the same table, through the same
        // shared listener (the first runtime's pools are gone with it).
        let store = store_of_this_runtime(&fixture, &shared).await;
        let mut listener = store.listen();
        assert!(listener.wait(DEADLINE).await, "a first catch-up report");
        wait_until("the shared connection listens again", DEADLINE, || {
            let up = shared.is_listening();
            async move { up }
        })
        .await;
        while listener.wait(Duration::from_millis(50)).await {}
        let _announcing = commit_elsewhere(&fixture).await;
        assert!(
            listener.wait(DEADLINE).await,
            "another process's commit wakes the later runtime's listener (its poll is an hour)"
        );
    });
}

/// The shared commit watcher's task and first connection belong to the
/// runtime it was made on. When that runtime shuts down, a store built on
/// a later one through the same listener still has its commits announced
/// to other processes: the task starts again on the later runtime, and the
/// watcher's pool replaces the connection it lost.
#[test]
fn a_watcher_whose_runtime_shut_down_still_announces_the_next_stores_commits() {
    let name = format!("shared-watcher-rt-{}", std::process::id());
    let first = tokio::runtime::Runtime::new().unwrap();
    let (shared, fixture) = first.block_on(async {
        let pool = named_pool(&name).await;
        let shared = PgSharedListener::new(&pool);
        let fixture = PgUnderTest::fresh_with(None, |b| b.listen_through(&shared)).await;
        // The watcher's connection is opened on this runtime.
        let mut raw = PgListener::connect(&database_url()).await.unwrap();
        raw.listen(&fixture.pg().channel()).await.unwrap();
        commit_one(fixture.pg()).await;
        tokio::time::timeout(DEADLINE, raw.recv())
            .await
            .expect("announced on the first runtime")
            .unwrap();
        (shared, fixture)
    });
    drop(first);

    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        let store = store_of_this_runtime(&fixture, &shared).await;
        let mut raw = PgListener::connect(&database_url()).await.unwrap();
        raw.listen(&store.channel()).await.unwrap();
        commit_one(&store).await;
        let note = tokio::time::timeout(DEADLINE, raw.recv())
            .await
            .expect("a commit on the later runtime is announced")
            .unwrap();
        assert_eq!(note.channel(), store.channel());
    });
}

#[tokio::test]
async fn a_store_that_only_polls_refuses_a_shared_listener() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://app:secretpw@127.0.0.1:1/shop")
        .unwrap();
    let shared = PgSharedListener::new(&pool);
    let e = PgStore::builder_with_pool(pool)
        .wake_up(WakeUp::PollOnly)
        .listen_through(&shared)
        .connect()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("listen_through"), "{e}");
    assert!(!format!("{shared:?}").contains("secretpw"));
}
