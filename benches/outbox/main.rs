//! `cargo bench --bench outbox`: every figure of `docs/performance.md`, each
//! beside a baseline measured in the same run where one applies. Prints a
//! table and writes `target/outbox-bench/summary.json`.
//! `OUTBOX_BENCH_QUICK=1` runs a smoke version (CI runs it so the benches
//! never rot). RabbitMQ figures use `OUTBOX_AMQP_URL`, PostgreSQL figures
//! `OUTBOX_PG_URL`, MySQL/MariaDB figures `OUTBOX_MYSQL_URL`, Kafka figures
//! `OUTBOX_KAFKA_URL`, else the local
//! default if it answers; without the
//! service their rows say NOT MEASURED.
//! `cargo bench --bench outbox -- sqlite` runs only the named groups
//! (memory, memory-metrics, sqlite, sqlite-metrics, sqlite-latency, postgres,
//! mysql, rabbitmq, nats, kafka, consumer; a name selects every group
//! containing it, so `sqlite` also runs `sqlite-latency`, and `drain` runs
//! only SQLite's drain figures).

mod common;
mod consumer;
mod kafka;
mod latency_trace;
mod memory;
mod mysql;
mod nats;
mod postgres;
mod rabbit;
mod sqlite;
mod sqlite_latency;

fn main() {
    if let Ok(n) = std::env::var("OUTBOX_BENCH_RSS_CHILD") {
        sqlite::rss_child(n.parse().expect("message count"));
        return;
    }
    if let Ok(spec) = std::env::var(consumer::CHILD_ENV) {
        consumer::victim_child(&spec);
        return;
    }
    let quick = common::quick();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let mut figures = Vec::new();
    // `cargo bench --bench outbox -- sqlite` runs only the groups named.
    let groups: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |g: &str| groups.is_empty() || groups.iter().any(|w| g.contains(w.as_str()));
    rt.block_on(async {
        if wanted("memory") {
            figures.extend(memory::figures(quick).await);
        }
        if wanted("memory-metrics") {
            figures.extend(memory::metrics_figures(quick).await);
        }
        if wanted("sqlite") {
            figures.extend(sqlite::figures(quick).await);
        } else if wanted("sqlite-drain") {
            figures.extend(sqlite::drain_figures(quick).await.0);
        }
        if wanted("sqlite-metrics") {
            figures.extend(sqlite::metrics_figures(quick).await);
        }
        if wanted("sqlite-latency") {
            figures.extend(sqlite_latency::figures(quick).await);
        }
        if postgres::PARTS.iter().any(|part| wanted(part)) {
            figures.extend(postgres::figures(quick, &wanted).await);
        }
        if wanted("mysql") {
            figures.extend(mysql::figures(quick).await);
        }
        if wanted("rabbitmq") {
            figures.extend(rabbit::figures(quick).await);
        }
        if wanted("nats") {
            figures.extend(nats::figures(quick).await);
        }
        if wanted("kafka") {
            figures.extend(kafka::figures(quick).await);
        }
        if wanted("consumer") {
            figures.extend(consumer::figures(quick).await);
        }
    });
    common::print_table(&figures);
    println!(
        "\n{} mode, {:.0} s, {} cores",
        if quick { "quick" } else { "full" },
        started.elapsed().as_secs_f64(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    common::write_summary(&figures);
}
