//! `relay-child`: an outbox relay in its own process, for the fault tests.
//!
//! Opens the outbox (table `outbox`) in `--outbox-db` and the receiver's
//! tables in `--receiver-db` (the same file is fine) — or, with
//! `--pg-schema NAME`, both in that schema of the PostgreSQL database whose
//! URL is in `OUTBOX_FAULTS_PG_URL` — runs `outbox::Relay`
//! with the [`Receiver`] (or [`PgReceiver`]) handler, and runs until it is killed or its stdin
//! closes (then it shuts the relay down gracefully and exits 0). Store and
//! handler errors go to stderr as `STORE_ERROR` / `HANDLER_ERROR` lines.
//!
//! ```text
//! relay-child --outbox-db app.db --receiver-db rx.db --worker w1 \
//!     [--batch 50] [--lease-ms 1000] [--handler-timeout-ms 800] [--poll-ms 50] \
//!     [--handler-delay-ms 0] [--concurrency 16] [--consumer faults]
//! OUTBOX_FAULTS_PG_URL=postgres://… relay-child --pg-schema faults_1 --worker w1 [options]
//! OUTBOX_FAULTS_PG_URL=postgres://… relay-child --pg-schema fleet --pg-tenants 100 --worker w1 [options]
//! OUTBOX_FAULTS_MYSQL_URL=mysql://… relay-child --mysql-prefix faults --worker w1 [options]
//! ```
//!
//! With `--mysql-prefix NAME` the outbox is the table `NAME_outbox` and the
//! receiver's tables `NAME_…` of the MySQL/MariaDB database whose URL is in
//! `OUTBOX_FAULTS_MYSQL_URL` (the [`MySqlReceiver`] handler).
//!
//! With `--pg-tenants N` it runs an `outbox::Fleet` over the schemas
//! `<schema>_0` … `<schema>_<N-1>` (migrated and prepared by the test), on
//! one pool and one shared `LISTEN` connection, each with its receiver;
//! `--poll-ms` is then the fleet's sweep and `--concurrency` its slots.

use std::process::ExitCode;
use std::sync::Arc;

use std::time::Duration;

use outbox::sqlite::SqliteStore;
use outbox::{Fleet, Relay, RelayConfig};
use outbox_api::{Dispatcher, Store};
use outbox_faults::mysql::{self as my, MySqlReceiver};
use outbox_faults::postgres::{PgReceiver, lazy_pool, with_application_name};
use outbox_faults::{ChildArgs, CountingStore, MYSQL_URL_VARIABLE, PG_URL_VARIABLE, Receiver};
use outbox_mysql::MySqlStore;
use outbox_postgres::{PgSharedListener, PgStore};

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OUTBOX_FAULTS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let args = match ChildArgs::parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("relay-child: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("relay-child: cannot start tokio: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("relay-child: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: ChildArgs) -> Result<(), String> {
    if let Some(prefix) = args.mysql_prefix.clone() {
        return run_mysql(args, &prefix).await;
    }
    match args.pg_schema.clone() {
        None => run_sqlite(args).await,
        Some(prefix) if args.pg_tenants > 0 => run_fleet(args, &prefix).await,
        Some(schema) => run_postgres(args, &schema).await,
    }
}

/// A fleet over `<prefix>_0` … `<prefix>_<N-1>` until stdin closes.
async fn run_fleet(args: ChildArgs, prefix: &str) -> Result<(), String> {
    let url = std::env::var(PG_URL_VARIABLE)
        .map_err(|_| format!("--pg-schema needs the database URL in {PG_URL_VARIABLE}"))?;
    let name = format!("faults-{prefix}-{}", args.worker);
    let pool = lazy_pool(
        &with_application_name(&url, &name),
        args.concurrency as u32 + 4,
        args.handler_timeout / 2,
    )?;
    let shared = PgSharedListener::new(&pool);
    let fleet = Fleet::builder()
        .worker_id(args.worker.clone())
        .concurrency(args.concurrency)
        .sweep_interval(args.poll_interval)
        .build()
        .map_err(|e| format!("building the fleet: {e}"))?;
    let mut receivers = Vec::new();
    for i in 0..args.pg_tenants {
        let schema = format!("{prefix}_{i}");
        let store = PgStore::builder_with_pool(pool.clone())
            .schema(&schema)
            .listen_through(&shared)
            .connect()
            .await
            .map_err(|e| format!("opening the outbox in {schema}: {e}"))?;
        let receiver = PgReceiver::open(
            pool.clone(),
            &schema,
            &args.consumer,
            &args.worker,
            args.handler_delay,
        )
        .await?;
        receivers.push(receiver.clone());
        fleet
            .add(
                schema,
                Relay::builder(store)
                    .dispatcher(receiver)
                    .config(config(&args)),
            )
            .map_err(|e| format!("adding an outbox to the fleet: {e}"))?;
    }
    outbox_api::testing::until_stdin_closes().await;
    fleet.shutdown().await;
    let handled: u64 = receivers.iter().map(|r| r.figures().0).sum();
    eprintln!(
        "relay-child {}: stopped; fleet of {} outboxes, handled={handled}",
        args.worker, args.pg_tenants
    );
    Ok(())
}

/// The relay's configuration from the command line.
fn config(args: &ChildArgs) -> RelayConfig {
    let mut config = RelayConfig::default();
    config.worker_id = args.worker.clone();
    config.batch_size = args.batch_size;
    config.lease = args.lease;
    config.handler_timeout = args.handler_timeout;
    config.poll_interval = args.poll_interval;
    config.concurrency = args.concurrency;
    config.store_error_backoff = args.poll_interval;
    config
}

async fn run_sqlite(args: ChildArgs) -> Result<(), String> {
    let store = SqliteStore::builder(&args.outbox_db)
        .connect()
        .await
        .map_err(|e| format!("opening the outbox: {e}"))?;
    store
        .migrate()
        .await
        .map_err(|e| format!("migrating the outbox: {e}"))?;
    let receiver = Receiver::open(
        &args.receiver_db,
        &args.consumer,
        &args.worker,
        args.handler_delay,
    )
    .await?;
    let report = receiver.clone();
    relay(&args, store, receiver, move || report.figures()).await
}

/// On PostgreSQL the database may be restarting while this process starts:
/// opening is retried for up to 30 s while the error says `Unavailable`.
async fn run_postgres(args: ChildArgs, schema: &str) -> Result<(), String> {
    let url = std::env::var(PG_URL_VARIABLE)
        .map_err(|_| format!("--pg-schema needs the database URL in {PG_URL_VARIABLE}"))?;
    let name = format!("faults-{schema}-{}", args.worker);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let store = loop {
        let opened = async {
            let store = PgStore::builder(with_application_name(&url, &name))
                .schema(schema)
                .poll_interval(args.poll_interval)
                .max_connections(4)
                .connect()
                .await?;
            store.migrate().await?;
            Ok::<_, outbox_api::Error>(store)
        }
        .await;
        match opened {
            Ok(store) => break store,
            Err(e)
                if e.kind() == outbox_api::ErrorKind::Unavailable
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(format!("opening the outbox: {e}")),
        }
    };
    let pool = lazy_pool(
        &with_application_name(&url, &format!("{name}-rx")),
        args.concurrency as u32,
        args.handler_timeout / 2,
    )?;
    let receiver = PgReceiver::open(
        pool,
        schema,
        &args.consumer,
        &args.worker,
        args.handler_delay,
    )
    .await?;
    let report = receiver.clone();
    relay(&args, store, receiver, move || report.figures()).await
}

/// On MySQL the server may be starting again while this process starts:
/// opening is retried for up to 30 s while the error says `Unavailable`.
async fn run_mysql(args: ChildArgs, prefix: &str) -> Result<(), String> {
    let url = std::env::var(MYSQL_URL_VARIABLE)
        .map_err(|_| format!("--mysql-prefix needs the database URL in {MYSQL_URL_VARIABLE}"))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (store, receiver) = loop {
        let opened = async {
            let store = MySqlStore::builder(&url)
                .table(my::outbox_table(prefix))
                .max_connections(4)
                .connect()
                .await
                .map_err(|e| (e.kind(), format!("opening the outbox: {e}")))?;
            let pool = my::lazy_pool(&url, args.concurrency as u32, args.handler_timeout / 2)
                .map_err(|e| (outbox_api::ErrorKind::Config, e))?;
            let receiver = MySqlReceiver::open(pool, &url, prefix, &args.consumer, &args.worker)
                .await
                .map_err(|e| (outbox_api::ErrorKind::Unavailable, e))?;
            Ok::<_, (outbox_api::ErrorKind, String)>((store, receiver))
        }
        .await;
        match opened {
            Ok(opened) => break opened,
            Err((outbox_api::ErrorKind::Unavailable, _))
                if std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err((_, e)) => return Err(e),
        }
    };
    let report = receiver.clone();
    relay(&args, store, receiver, move || report.figures()).await
}

/// Runs the relay on `store` with `dispatcher` until stdin closes (the
/// test's "stop") — or until SIGKILL; `receiver` reports the handler's
/// figures (handled, duplicates, errors).
async fn relay<S: Store + Clone + 'static>(
    args: &ChildArgs,
    store: S,
    dispatcher: impl Dispatcher + 'static,
    receiver: impl Fn() -> (u64, u64, usize),
) -> Result<(), String> {
    let store = CountingStore::new(store, &args.worker);
    let handle = Relay::builder_shared(Arc::new(store.clone()))
        .dispatcher(dispatcher)
        .config(config(args))
        .spawn()
        .map_err(|e| format!("starting the relay: {e}"))?;

    outbox_api::testing::until_stdin_closes().await;
    handle.shutdown().await;
    let t = handle.totals();
    let (handled, duplicates, handler_errors) = receiver();
    eprintln!(
        "relay-child {}: stopped; delivered={} failed={} released={} handled={handled} \
         duplicates={duplicates} store_errors={} handler_errors={handler_errors}",
        args.worker,
        t.delivered,
        t.failed,
        t.released,
        store.errors().len(),
    );
    Ok(())
}
