//! `relay-child`: an outbox relay in its own process, for the fault tests.
//!
//! Opens the outbox (table `outbox`) in `--outbox-db` and the receiver's
//! tables in `--receiver-db` (the same file is fine), runs `outbox::Relay`
//! with the [`Receiver`] handler, and runs until it is killed or its stdin
//! closes (then it shuts the relay down gracefully and exits 0). Store and
//! handler errors go to stderr as `STORE_ERROR` / `HANDLER_ERROR` lines.
//!
//! ```text
//! relay-child --outbox-db app.db --receiver-db rx.db --worker w1 \
//!     [--batch 50] [--lease-ms 1000] [--handler-timeout-ms 800] [--poll-ms 50] \
//!     [--handler-delay-ms 0] [--concurrency 16] [--consumer faults]
//! ```

use std::io::Read;
use std::process::ExitCode;
use std::sync::Arc;

use outbox::sqlite::SqliteStore;
use outbox::{Relay, RelayConfig};
use outbox_faults::{ChildArgs, CountingStore, Receiver};

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
    let store = SqliteStore::builder(&args.outbox_db)
        .open()
        .await
        .map_err(|e| format!("opening the outbox: {e}"))?;
    store
        .migrate()
        .await
        .map_err(|e| format!("migrating the outbox: {e}"))?;
    let store = CountingStore::new(store, &args.worker);
    let receiver = Receiver::open(
        &args.receiver_db,
        &args.consumer,
        &args.worker,
        args.handler_delay,
    )
    .await?;
    let mut config = RelayConfig::default();
    config.worker_id = args.worker.clone();
    config.batch_size = args.batch_size;
    config.lease = args.lease;
    config.handler_timeout = args.handler_timeout;
    config.poll_interval = args.poll_interval;
    config.concurrency = args.concurrency;
    config.store_error_backoff = args.poll_interval;
    let handle = Relay::builder_shared(Arc::new(store.clone()))
        .dispatcher(receiver.clone())
        .config(config)
        .spawn()
        .map_err(|e| format!("starting the relay: {e}"))?;

    // Run until stdin closes (the test's "stop") — or until SIGKILL.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
        let _ = tx.send(());
    });
    let _ = rx.await;
    handle.shutdown().await;
    let t = handle.totals();
    eprintln!(
        "relay-child {}: stopped; delivered={} failed={} released={} handled={} duplicates={} store_errors={} handler_errors={}",
        args.worker,
        t.delivered,
        t.failed,
        t.released,
        receiver.handled(),
        receiver.duplicates(),
        store.errors().len(),
        receiver.errors().len()
    );
    Ok(())
}
