//! # MiniShop — the outbox-rs demo
//!
//! Two modules, each with its own database and outbox — a SQLite file each,
//! a PostgreSQL schema each with `--postgres URL`, or a MySQL/MariaDB
//! database each with `--mysql URL` — and one saga between them:
//!
//! 1. **Ordering** (`ordering.db`) places an order: the `orders` row and an
//!    `OrderPlaced` integration message commit in one transaction.
//! 2. **Warehouse** (`warehouse.db`) receives `OrderPlaced` through its
//!    inbox and, in one transaction, records the inbox entry, reserves the
//!    stock if there is enough, and enqueues `StockReserved` or
//!    `StockRejected`.
//! 3. **Ordering** receives the answer through its inbox and, in one
//!    transaction, confirms or cancels the order; a confirmation also
//!    enqueues the domain message `OrderConfirmed`.
//! 4. Ordering's relay hands `OrderConfirmed` to an in-process handler,
//!    which records when the saga ended.
//!
//! Each module runs its own relay. Integration messages travel through an
//! in-process bus by default, through RabbitMQ with `--amqp URL`, or
//! through NATS JetStream with `--nats URL`.
//!
//! With PostgreSQL or MySQL and a broker (RabbitMQ or NATS) the modules
//! can also run as separate processes: one `--role ordering` and any
//! number of `--role warehouse --replica I --replicas N`, sharing the
//! warehouse's schema (or database) and consuming `OrderPlaced` from
//! key-partitioned queues or subjects ([`replica`]).
//!
//! ```text
//! cargo run --release -p minishop -- --orders 200         # load run + summary
//! cargo run --release -p minishop                         # HTTP API on 127.0.0.1:8080
//! cargo run --release -p minishop -- --amqp amqp://guest:guest@127.0.0.1:5672/%2f --orders 200
//! cargo run --release -p minishop -- --nats nats://127.0.0.1:4222 --orders 200
//! cargo run --release -p minishop -- --postgres postgres://postgres@127.0.0.1:5432/test --orders 200
//! cargo run --release -p minishop -- --mysql mysql://root@127.0.0.1:3306/test --orders 200
//! # several processes (each line in its own terminal):
//! minishop --amqp URL --postgres URL --role warehouse --replica 0 --replicas 2
//! minishop --amqp URL --postgres URL --role warehouse --replica 1 --replicas 2
//! minishop --amqp URL --postgres URL --role ordering --orders 500
//! # the same over NATS: --nats nats://127.0.0.1:4222 instead of --amqp URL,
//! # on MySQL: --mysql URL instead of --postgres URL
//! ```
#![forbid(unsafe_code)]

mod amqp;
mod consumer;
mod db;
mod fail;
mod health;
mod http;
mod inbox;
mod load;
mod messages;
mod nats;
mod ordering;
mod replica;
mod shop;
mod warehouse;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::amqp::AmqpNames;
use crate::db::Location;
use crate::fail::Fail;
use crate::load::LoadOptions;
use crate::shop::{Bus, Modules, Shop};

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// Human-readable lines (the default).
    Text,
    /// One JSON object a line, with the spans it was logged in (a
    /// delivery's span holds the message's `trace_parent`, hence its trace id).
    Json,
}

/// Whether spans go out over OTLP: the standard variables
/// `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
/// are set, and `OTEL_TRACES_EXPORTER` does not say `none`.
fn otlp_configured() -> bool {
    let set = |v: &str| std::env::var(v).is_ok_and(|v| !v.trim().is_empty());
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        && std::env::var("OTEL_TRACES_EXPORTER").map_or(true, |v| v.trim() != "none")
}

/// The OpenTelemetry tracer provider: spans batched to an OTLP/HTTP
/// exporter when [`otlp_configured`] (endpoint, protocol — `http/protobuf`
/// or `http/json` —, headers and timeout from the standard `OTEL_*`
/// variables; the service is `minishop` unless `OTEL_SERVICE_NAME` says
/// otherwise), else kept in the process only (messages still carry their
/// trace context).
fn tracer_provider() -> Result<opentelemetry_sdk::trace::SdkTracerProvider, Fail> {
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name("minishop");
    }
    let mut builder =
        opentelemetry_sdk::trace::SdkTracerProvider::builder().with_resource(resource.build());
    if otlp_configured() {
        use opentelemetry_otlp::WithExportConfig as _;
        let protocol = match std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").as_deref() {
            Ok("http/json") => opentelemetry_otlp::Protocol::HttpJson,
            Ok("http/protobuf") | Err(_) => opentelemetry_otlp::Protocol::HttpBinary,
            Ok(other) => {
                return Err(Fail(format!(
                    "OTEL_EXPORTER_OTLP_PROTOCOL={other}: MiniShop exports over OTLP/HTTP: \
                     http/protobuf (the default) or http/json"
                )));
            }
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(protocol)
            .build()
            .map_err(|e| Fail(format!("the OTLP span exporter: {e}")))?;
        builder = builder.with_batch_exporter(exporter);
    }
    Ok(builder.build())
}

/// Logs on standard error, filtered by `RUST_LOG` (default: warnings), in
/// `format`; and the spans of requests and deliveries, whatever the log
/// filter, to OpenTelemetry, so that each message enqueued carries the
/// trace of the request or delivery it was enqueued in (and, with OTLP
/// configured, the spans are exported). Returns the provider, to flush at
/// exit.
fn init_tracing(format: LogFormat) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, Fail> {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::filter::FilterExt as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    // Events as RUST_LOG says; spans at info whatever it says, so that each
    // line names the request or delivery (and so the trace) it belongs to.
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(
                |_| // The relays report an unavailable transport themselves;
                // the RabbitMQ transport's own retry chatter stays quiet.
                tracing_subscriber::EnvFilter::new("warn,outbox_rabbitmq::transport=error"),
            )
            .or(tracing_subscriber::filter::filter_fn(|m| {
                m.is_span() && *m.level() <= tracing::Level::INFO
            }))
    };
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter())
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .with_writer(std::io::stderr)
            .with_filter(filter())
            .boxed(),
    };
    let provider = tracer_provider()?;
    // No per-layer filter on the span layer: with one (a `LevelFilter` at
    // info) it lost spans at random on PostgreSQL — requests, deliveries —
    // beside sqlx's debug events on the same threads, so messages were
    // enqueued without their trace (tracing-subscriber's per-layer filter
    // state; `spans_of_each_saga_on_postgresql_are_one_trace_from_the_request`).
    // No span in this process is below info but libraries' own, and none of
    // those make spans here.
    let spans = tracing_opentelemetry::layer().with_tracer(provider.tracer("minishop"));
    tracing_subscriber::registry().with(logs).with(spans).init();
    Ok(provider)
}

/// Which modules a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Both modules in this process (the default).
    All,
    /// Ordering only: places orders (--orders N or the HTTP API); the
    /// warehouse runs in `--role warehouse` processes.
    Ordering,
    /// One warehouse replica (--replica I --replicas N), until Ctrl-C.
    Warehouse,
}

/// MiniShop: the outbox-rs demo — two modules, two databases, one saga.
///
/// Without --orders it serves an HTTP API; with --orders N it places N
/// orders, waits for every saga to end and prints a summary.
#[derive(Debug, Parser)]
#[command(name = "minishop", version)]
struct Args {
    /// Log lines as text or as JSON objects (with the spans they were
    /// logged in: a delivery's holds its message's trace).
    #[arg(long, value_enum, env = "MINISHOP_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,

    /// Where the two SQLite databases live (ordering.db, warehouse.db).
    /// Not used with --postgres or --mysql.
    #[arg(long, value_name = "DIR", default_value = "./minishop-data")]
    data_dir: PathBuf,

    /// Run both modules on PostgreSQL at URL instead of SQLite, a schema
    /// each (`ordering`, `warehouse`), e.g.
    /// postgres://postgres@127.0.0.1:5432/test. The password is never printed.
    #[arg(long, value_name = "URL")]
    postgres: Option<String>,

    /// Run both modules on MySQL or MariaDB at URL instead of SQLite, a
    /// database each beside URL's database DB (`DB_ordering`,
    /// `DB_warehouse`, created if missing), e.g.
    /// mysql://root@127.0.0.1:3306/test. The user needs the right to create
    /// (with --fresh or --isolated, to drop) them. The password is never
    /// printed.
    #[arg(long, value_name = "URL", conflicts_with = "postgres")]
    mysql: Option<String>,

    /// Delete the shop's data first: its two databases in the data dir, or
    /// its two schemas (with --postgres) or databases (with --mysql).
    #[arg(long)]
    fresh: bool,

    /// Carry integration messages through RabbitMQ at URL instead of the
    /// in-process bus, e.g. amqp://guest:guest@127.0.0.1:5672/%2f.
    #[arg(
        long,
        value_name = "URL",
        env = "OUTBOX_AMQP_URL",
        hide_env_values = true
    )]
    amqp: Option<String>,

    /// Carry integration messages through NATS JetStream at URL instead
    /// of the in-process bus, e.g. nats://127.0.0.1:4222.
    #[arg(
        long,
        value_name = "URL",
        env = "OUTBOX_NATS_URL",
        hide_env_values = true,
        conflicts_with = "amqp"
    )]
    nats: Option<String>,

    /// With --amqp, --nats, --postgres and/or --mysql: use queue, exchange
    /// and stream names, PostgreSQL schemas and MySQL databases unique to
    /// this run (deleted at exit), so that parallel runs do not share them.
    #[arg(long, conflicts_with = "run")]
    isolated: bool,

    /// With --amqp, --nats, --postgres and/or --mysql: suffix the queue,
    /// exchange, stream, schema and database names with this id (letters and
    /// digits), so that the processes of one run share them and other runs
    /// do not. Nothing is deleted at exit.
    #[arg(long, value_name = "ID", value_parser = parse_run_id)]
    run: Option<String>,

    /// Which modules this process runs: `all`, or — with --amqp or --nats,
    /// and --postgres or --mysql — `ordering` or `warehouse` in processes of
    /// their own.
    #[arg(long, value_enum, default_value = "all")]
    role: Role,

    /// With --role warehouse: this process's index, 0 to --replicas - 1.
    /// Each replica needs its own (its relay's worker id is
    /// `minishop-warehouse-<I>`).
    #[arg(long, value_name = "I", default_value_t = 0)]
    replica: u16,

    /// With --role warehouse: how many warehouse processes share the
    /// partitions.
    #[arg(long, value_name = "N", default_value_t = 1)]
    replicas: u16,

    /// With --amqp or --nats: how many partition queues (or subjects) each
    /// module consumes, a worker each (the same in every process of a run;
    /// at least --replicas, or some replicas only stand by). 0: one queue
    /// (or subject) per module, one delivery at a time, in one process
    /// only (--role all).
    #[arg(long, value_name = "P", default_value_t = 6)]
    partitions: u16,

    /// Place N orders, wait until every saga ended, print a summary, exit.
    #[arg(long, value_name = "N")]
    orders: Option<u64>,

    /// With --orders: place at most this many orders per second (default:
    /// as fast as they commit).
    #[arg(long, value_name = "PER_SECOND", value_parser = parse_rate)]
    rate: Option<f64>,

    /// With --orders: how many orders may be being placed at once, each in
    /// a transaction of its own (the shop's customers at the checkout).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    placers: u16,

    /// With --orders: give up after this long (e.g. 120s, 2m, 500ms),
    /// exiting non-zero and saying what is stuck.
    #[arg(long, value_name = "DURATION", default_value = "120s", value_parser = parse_duration)]
    timeout: Duration,

    /// With --orders: sample every millisecond whether each module's
    /// application pool has all its connections in use, and print the
    /// share of samples that found it so (a share near 100 % is the
    /// run's bound).
    #[arg(long)]
    sample_pools: bool,

    /// Without --orders: the HTTP address (port 0 picks a free one).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: String,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (e.g. 120s, 2m, 500ms)"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        other => return Err(format!("unknown unit `{other}` (use ms, s, m or h)")),
    };
    if !(secs > 0.0 && secs < 1e9) {
        return Err("must be greater than zero".into());
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_run_id(text: &str) -> Result<String, String> {
    let ok = !text.is_empty()
        && text.len() <= 24
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if ok {
        Ok(text.to_owned())
    } else {
        Err("must be 1 to 24 lower-case letters and digits".into())
    }
}

/// Checks the flags of `--role`; returns the warehouse replica (index, count).
fn check_role(args: &Args) -> Result<(u16, u16), Fail> {
    if args.partitions > outbox::rabbitmq::MAX_PARTITIONS {
        return Err(Fail(format!(
            "--partitions must be 0 to {}",
            outbox::rabbitmq::MAX_PARTITIONS
        )));
    }
    if args.partitions == 0 && args.role != Role::All {
        return Err(Fail(
            "--partitions 0 (one queue per module) needs --role all: processes of one module share its partitions".into(),
        ));
    }
    let role = match args.role {
        Role::All => {
            for (set, flag) in [
                (args.replica != 0, "--replica"),
                (args.replicas != 1, "--replicas"),
            ] {
                if set {
                    return Err(Fail(format!("{flag} needs --role warehouse")));
                }
            }
            return Ok((0, 1));
        }
        Role::Ordering => "--role ordering",
        Role::Warehouse => "--role warehouse",
    };
    if args.amqp.is_none() && args.nats.is_none() {
        return Err(Fail(format!(
            "{role} needs --amqp URL (or OUTBOX_AMQP_URL) or --nats URL (or OUTBOX_NATS_URL): the processes talk through a broker"
        )));
    }
    if args.postgres.is_none() && args.mysql.is_none() {
        return Err(Fail(format!(
            "{role} needs --postgres URL or --mysql URL: the warehouse replicas share its `warehouse` schema (or database)"
        )));
    }
    if args.isolated {
        return Err(Fail(format!(
            "{role} cannot use --isolated (its names would be this process's own): give every process of the run the same --run ID"
        )));
    }
    if args.fresh {
        return Err(Fail(format!(
            "{role} cannot use --fresh (a process would drop the others' data): drop the schemas (or databases) before starting them"
        )));
    }
    if args.role == Role::Ordering && (args.replica != 0 || args.replicas != 1) {
        return Err(Fail(
            "--replica and --replicas need --role warehouse".into(),
        ));
    }
    if args.role == Role::Warehouse && args.orders.is_some() {
        return Err(Fail(
            "--orders needs --role all or ordering (a warehouse process only answers)".into(),
        ));
    }
    if args.replicas == 0 || args.replica >= args.replicas {
        return Err(Fail(format!(
            "--replica must be 0 to --replicas - 1 (got --replica {} --replicas {})",
            args.replica, args.replicas
        )));
    }
    Ok((args.replica, args.replicas))
}

/// The id in this run's names: its own with --isolated, --run's, or none.
fn run_id(args: &Args) -> Option<String> {
    if args.isolated {
        let id = uuid::Uuid::now_v7().simple().to_string();
        // The tail of a v7 id is random; the head is the time.
        Some(id[id.len() - 12..].to_owned())
    } else {
        args.run.clone()
    }
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(r) if r > 0.0 && r.is_finite() => Ok(r),
        _ => Err(format!(
            "`{text}` is not a positive number of orders per second"
        )),
    }
}

async fn run(args: Args) -> Result<(), Fail> {
    if args.isolated
        && args.amqp.is_none()
        && args.nats.is_none()
        && args.postgres.is_none()
        && args.mysql.is_none()
    {
        return Err(Fail(
            "--isolated needs --amqp (or OUTBOX_AMQP_URL), --nats (or OUTBOX_NATS_URL), --postgres or --mysql"
                .into(),
        ));
    }
    if args.rate.is_some() && args.orders.is_none() {
        return Err(Fail("--rate needs --orders".into()));
    }
    let replica = check_role(&args)?;
    let run = run_id(&args);
    // With a broker, both modules consume partition queues (or subjects), a
    // worker each, in one process too: their inbox transactions and the
    // broker's round trips overlap. On SQLite the workers take turns for
    // the file's write lock, but in short steps (`SqliteOutbox::attach`), so
    // this still pays: at 600 orders/s offered through RabbitMQ, 579–595
    // sustained against 495–506 on one queue each (docs/latency.md).
    // `--partitions 0` keeps one queue per module.
    let partitions = (args.partitions > 0).then_some(args.partitions);
    // A malformed URL fails before anything is touched.
    let bus = match (&args.amqp, &args.nats) {
        (Some(url), _) => Bus::Amqp {
            redacted: amqp::check_url(url)?,
            url: url.clone(),
            names: Box::new(AmqpNames::new(run.as_deref(), args.isolated, partitions)?),
        },
        (None, Some(url)) => Bus::Nats {
            redacted: nats::check_url(url)?,
            url: url.clone(),
            names: nats::NatsNames::new(run.as_deref(), args.isolated, partitions),
        },
        (None, None) => Bus::Embedded,
    };
    let location = match (&args.postgres, &args.mysql) {
        (Some(url), _) => Location::postgres(url, run.as_deref())?,
        (None, Some(url)) => Location::mysql(url, run.as_deref())?,
        (None, None) => Location::Sqlite {
            dir: args.data_dir.clone(),
        },
    };
    location.prepare(args.fresh).await?;
    if args.role == Role::Warehouse {
        // Before the relay and consumer start, so that they record into it.
        let _metrics = http::install_metrics()?;
        return replica::run(&location, &bus, replica).await;
    }
    let modules = match args.role {
        Role::Ordering => Modules::OrderingOnly,
        _ => Modules::Both,
    };
    // An isolated run's schemas (PostgreSQL) or databases (MySQL) go at exit.
    let isolated_db = args.isolated && (args.postgres.is_some() || args.mysql.is_some());
    // Before the relays and consumers start, so that they record into it.
    let metrics = http::install_metrics()?;
    let started = Shop::start(&location, bus, modules).await;
    let result = match started {
        Ok(shop) => {
            eprintln!(
                "MiniShop: {}, messages through {}",
                location.describe(),
                shop.bus_description
            );
            serve_or_load(shop, &args, metrics).await
        }
        Err(e) => Err(e),
    };
    if isolated_db {
        if let Err(e) = location.drop_modules("--isolated").await {
            tracing::warn!("could not drop this run's schemas or databases: {e}");
        }
    }
    result
}

/// Runs the load (`--orders`) or the HTTP API until Ctrl-C.
async fn serve_or_load(
    shop: Shop,
    args: &Args,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
) -> Result<(), Fail> {
    match args.orders {
        Some(orders) => {
            let opts = LoadOptions {
                orders,
                rate: args.rate,
                placers: usize::from(args.placers),
                timeout: args.timeout,
                sample_pools: args.sample_pools,
            };
            let result = load::run(&shop, opts).await;
            shop.shutdown().await;
            println!("{}", result?);
            Ok(())
        }
        None => {
            let shop = Arc::new(shop);
            let served = http::serve(Arc::clone(&shop), &args.listen, metrics).await;
            match Arc::try_unwrap(shop) {
                Ok(shop) => shop.shutdown().await,
                Err(shop) => {
                    // A request still holds the shop: stop the relays anyway.
                    shop.stop_relays().await;
                }
            }
            served?;
            eprintln!("MiniShop stopped.");
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let provider = match init_tracing(args.log_format) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    std::panic::set_hook(Box::new(|info| {
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        tracing::error!("panic{location}: {message}");
    }));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    };
    // The spans not yet exported go out before the process ends.
    if let Err(e) = provider.shutdown() {
        eprintln!("warning: exporting the last spans: {e}");
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("120s"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("3 fortnights").is_err());
    }

    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }
}
