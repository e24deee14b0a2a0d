//! [`PgStoreBuilder`]: the configuration of a [`PgStore`], and connecting.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use outbox_api::backend::redact_url;
use outbox_api::{Clock, Error, Result, SystemClock};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::error::{connecting, password_of};
use crate::floor::DEFAULT_FLOOR_STEP;
use crate::listener::WakeUp;
use crate::queue::StatementQueue;
use crate::schema::{self, Names};
use crate::shared_listener::PgSharedListener;
use crate::store::PgStore;
use crate::store::Tuning;

/// How many connections a store opens at most (relays, operators and the
/// commit watcher share them).
pub const DEFAULT_MAX_CONNECTIONS: u32 = 8;
/// How long connecting, or waiting for a free connection, may take.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a listener reports a change when it cannot `LISTEN` (or with
/// [`WakeUp::PollOnly`]).
pub const DEFAULT_POLL: Duration = Duration::from_millis(500);
/// At most one `NOTIFY` per table per this interval from one process.
pub const DEFAULT_NOTIFY_DEBOUNCE: Duration = Duration::from_millis(1);

/// Where a store's connections come from.
enum Source {
    Url(String),
    Pool(PgPool),
}

/// Configures and connects a [`PgStore`]; see [`PgStore::builder`].
pub struct PgStoreBuilder {
    source: Source,
    pub(crate) schema: String,
    pub(crate) table: String,
    pub(crate) inbox_table: String,
    clock: Arc<dyn Clock>,
    max_connections: u32,
    connect_timeout: Duration,
    /// The first setting of the pool the store opens that was set (refused
    /// with `builder_with_pool`, whose pool has its own).
    pool_setting: Option<&'static str>,
    wake_up: WakeUp,
    shared_listener: Option<PgSharedListener>,
    poll: Duration,
    notify_debounce: Duration,
    announce_commits: bool,
    floor_step: Duration,
    durable_bookkeeping: bool,
    keep_processed: bool,
    /// The pool of the store's large statements (`PgTenantPools::builder`).
    pub(crate) bulk: Option<PgPool>,
    /// The queue of the claims and completions of the stores pinned to the
    /// same pool (`PgTenantPools::builder`).
    pub(crate) queue: Option<Arc<StatementQueue>>,
}

impl std::fmt::Debug for PgStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match &self.source {
            Source::Url(url) => redact_url(url),
            Source::Pool(pool) => describe(&pool.connect_options()),
        };
        f.debug_struct("PgStoreBuilder")
            .field("source", &source)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("inbox_table", &self.inbox_table)
            .field("wake_up", &self.wake_up)
            .field("shared_listener", &self.shared_listener.is_some())
            .field("bulk_pool", &self.bulk.is_some())
            .finish_non_exhaustive()
    }
}

/// `postgres://user@host:port/database`, never with a password.
pub(crate) fn describe(o: &PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        o.get_database().unwrap_or("")
    )
}

impl PgStoreBuilder {
    /// The PostgreSQL schema holding the tables (default `public`).
    /// Lower-case letters, digits and `_`; not `pg_…`.
    pub fn schema(mut self, name: impl Into<String>) -> Self {
        self.schema = name.into();
        self
    }

    /// The outbox table's name (default `outbox`): one outbox per module or
    /// database. The same rules on every store
    /// ([`validate_table_name`](outbox_api::backend::validate_table_name)):
    /// lower-case letters, digits and `_`, at most 48 characters.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// The inbox table's name (default `outbox_inbox`), validated like
    /// [`table`](Self::table).
    pub fn inbox_table(mut self, name: impl Into<String>) -> Self {
        self.inbox_table = name.into();
        self
    }

    /// Where enqueue timestamps come from (default: the wall clock). Give it
    /// the relay's clock in tests that move time.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// How many connections the store opens at most (default 8). A store
    /// built on an application's pool ([`PgStore::builder_with_pool`])
    /// uses that pool's size: setting this there is refused at
    /// [`connect`](Self::connect).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self.pool_setting.get_or_insert("max_connections");
        self
    }

    /// How long connecting, or waiting for a free connection, may take
    /// before an `Unavailable` error (default 5 s). Refused for a store
    /// built on an application's pool, as
    /// [`max_connections`](Self::max_connections) is.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self.pool_setting.get_or_insert("connect_timeout");
        self
    }

    /// How relays learn about other processes' commits (default
    /// [`WakeUp::ListenNotify`]; [`WakeUp::PollOnly`] behind PgBouncer in
    /// transaction mode).
    pub fn wake_up(mut self, mode: WakeUp) -> Self {
        self.wake_up = mode;
        self
    }

    /// Listens for other processes' commits through `shared`, one `LISTEN`
    /// connection for every store built with it (a fleet's tenant schemas
    /// in one database), instead of a connection per listening relay. With
    /// [`WakeUp::PollOnly`] nothing listens and this is refused.
    pub fn listen_through(mut self, shared: &PgSharedListener) -> Self {
        self.shared_listener = Some(shared.clone());
        self
    }

    /// How often a listener reports a change when it cannot `LISTEN`
    /// (default 500 ms): each report makes its relay claim once.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll = interval;
        self
    }

    /// The shortest time between two `NOTIFY`s of this table from this
    /// process (default [`DEFAULT_NOTIFY_DEBOUNCE`], 1 ms). A commit inside the interval is announced
    /// at its end, never dropped.
    pub fn notify_debounce(mut self, interval: Duration) -> Self {
        self.notify_debounce = interval;
        self
    }

    /// Whether enqueues through this store's [`PgOutbox`](crate::PgOutbox)
    /// announce their commits (default `true`): the store watches each
    /// enqueuing transaction, wakes this process's relays when it has
    /// committed and tells other processes with a debounced `NOTIFY`. With
    /// `false` nothing watches or notifies, and relays find new messages
    /// only by their `poll_interval` (the relay's, 2 s by default): for
    /// writers whose relays all poll anyway, or to measure what the
    /// announcement costs (the bench figure *enqueue throughput, 8 writers,
    /// wake-up on vs off*).
    pub fn announce_commits(mut self, announce: bool) -> Self {
        self.announce_commits = announce;
        self
    }

    /// Whether the relays' own bookkeeping — claims, completions, failures,
    /// releases, the retention purge — waits for a WAL flush at commit
    /// (default `false`). The application's enqueues and inbox
    /// transactions always do; these need not: a server crash takes back at
    /// most the last few hundred milliseconds of them (the server's
    /// `wal_writer_delay` three times over), which delivers those messages
    /// again and loses none (docs/rules.md, "Server crash"). With `true`
    /// every one of those commits waits for the disk — on a machine that
    /// flushes 1,700 times a second, a relay draining 10k messages a second
    /// needs most of that — for fewer redeliveries after a server crash.
    pub fn durable_bookkeeping(mut self, durable: bool) -> Self {
        self.durable_bookkeeping = durable;
        self
    }

    /// Whether a completed message stays in the table as `processed`
    /// (default `true`) until the relay's `retention` purges it. Operators
    /// see it there: the console's history, saga and activity pages,
    /// `outbox show`, the processed count of `stats`.
    ///
    /// With `false` a completion deletes the message, as a job queue
    /// forgets a finished job: one row version fewer per message and
    /// nothing for a purge to do (the bench figure *drain … against DELETE
    /// … RETURNING, keep_processed(false)*). Every delivery rule holds as
    /// with `true`: a deleted message counts as processed for its key's
    /// order (docs/rules.md, "Completion"). What is given up is the
    /// record: a delivered message is gone, the activity page counts no
    /// deliveries, and a message id may be enqueued again once the message
    /// that had it was delivered (ids are unique among the rows kept).
    pub fn keep_processed(mut self, keep: bool) -> Self {
        self.keep_processed = keep;
        self
    }

    /// The least time between two steps of the claim's floor (default
    /// [`DEFAULT_FLOOR_STEP`], 25 ms): how soon after messages complete
    /// claims stop stepping over their index entries while a long
    /// transaction keeps vacuum from removing them (see the crate docs).
    /// Each step takes one transaction id. Zero steps after every claim
    /// (for tests that want the floor to move as often as it can).
    pub fn claim_floor_step(mut self, step: Duration) -> Self {
        self.floor_step = step;
        self
    }

    /// Validates the configuration and connects. Does not create tables:
    /// call [`PgStore::migrate`].
    pub async fn connect(self) -> Result<PgStore> {
        let names = Names::new(&self.schema, &self.table, &self.inbox_table)?;
        for (field, value) in [
            ("poll_interval", self.poll),
            ("connect_timeout", self.connect_timeout),
        ] {
            if value.is_zero() {
                return Err(Error::config(field, "must be greater than zero"));
            }
        }
        if self.shared_listener.is_some() && self.wake_up == WakeUp::PollOnly {
            return Err(Error::config(
                "listen_through",
                "a store that only polls (WakeUp::PollOnly) does not listen: drop one of the two",
            ));
        }
        if self.max_connections == 0 {
            return Err(Error::config("max_connections", "must be at least 1"));
        }
        let (pool, display) = match self.source {
            Source::Pool(_) if self.pool_setting.is_some() => {
                let field = self.pool_setting.unwrap_or_default();
                return Err(Error::config(
                    field,
                    "applies to the pool the store opens; a store on the application's pool \
                     (builder_with_pool) uses that pool's own settings: set them on the pool",
                ));
            }
            Source::Pool(pool) => {
                let display = describe(&pool.connect_options());
                (pool, display)
            }
            Source::Url(url) => {
                let display = redact_url(&url);
                let options = PgConnectOptions::from_str(&url).map_err(|e| {
                    let err = connecting(e, &display, password_of(&url));
                    Error::config("url", format!("`{display}` is not a valid PostgreSQL URL"))
                        .with_source(err)
                })?;
                let options = if options.get_application_name().is_none() {
                    options.application_name("outbox-rs")
                } else {
                    options
                };
                // The pool is the store's alone: its connections carry the
                // claim's settings for their session, so a claim is one
                // statement (docs/decisions.md, "claims in one statement
                // where the session allows it").
                let options = crate::claim_sql::with_claim_settings(options);
                let pool = PgPoolOptions::new()
                    .max_connections(self.max_connections)
                    .acquire_timeout(self.connect_timeout)
                    // A broken connection surfaces as an error on use, and
                    // the relay retries: no ping before every statement.
                    .test_before_acquire(false)
                    .connect_with(options)
                    .await
                    .map_err(|e| connecting(e, &display, password_of(&url)))?;
                (pool, display)
            }
        };
        Ok(PgStore::assemble(
            pool,
            display,
            names,
            self.clock,
            Tuning {
                wake_up: self.wake_up,
                shared_listener: self.shared_listener,
                poll: self.poll,
                announce: self.announce_commits.then_some(self.notify_debounce),
                floor_step: self.floor_step,
                durable_bookkeeping: self.durable_bookkeeping,
                keep_processed: self.keep_processed,
                bulk: self.bulk,
                queue: self.queue,
            },
        ))
    }
}

impl PgStore {
    /// Connects to the database at `url` (`postgres://user:password@host:port/db`)
    /// with the default schema and table names.
    pub async fn connect(url: &str) -> Result<PgStore> {
        Self::builder(url).connect().await
    }

    /// A builder for the database at `url`: names, clock, pool size, wake-up.
    ///
    /// The store opens a pool of its own, whose connections run under the
    /// claim's settings for their whole session (`lock_timeout = 10s`; no
    /// sort, bitmap or sequential scan; generic plans; no JIT), after any
    /// options the URL gives: a claim is one statement, its own
    /// transaction. Statements of the application belong on a pool of its
    /// own, not on [`PgStore::pool`].
    pub fn builder(url: impl Into<String>) -> PgStoreBuilder {
        Self::builder_from(Source::Url(url.into()))
    }

    /// A builder for a store on the application's own pool (its size and
    /// timeouts apply). `LISTEN` connections are opened beside the pool,
    /// with the same options, never taken from it.
    pub fn builder_with_pool(pool: PgPool) -> PgStoreBuilder {
        Self::builder_from(Source::Pool(pool))
    }

    fn builder_from(source: Source) -> PgStoreBuilder {
        PgStoreBuilder {
            source,
            schema: schema::DEFAULT_SCHEMA.to_owned(),
            table: schema::DEFAULT_OUTBOX_TABLE.to_owned(),
            inbox_table: schema::DEFAULT_INBOX_TABLE.to_owned(),
            clock: Arc::new(SystemClock),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            pool_setting: None,
            wake_up: WakeUp::default(),
            shared_listener: None,
            poll: DEFAULT_POLL,
            notify_debounce: DEFAULT_NOTIFY_DEBOUNCE,
            announce_commits: true,
            floor_step: DEFAULT_FLOOR_STEP,
            durable_bookkeeping: false,
            keep_processed: true,
            bulk: None,
            queue: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use sqlx::postgres::PgPoolOptions;

    use super::*;

    #[tokio::test]
    async fn pool_settings_on_an_applications_pool_are_refused_not_ignored() {
        // A lazy pool never connects: the refusal comes first.
        let pool = PgPoolOptions::new()
            .connect_lazy("postgres://app:secretpw@127.0.0.1:1/shop")
            .unwrap();
        for (builder, field) in [
            (
                PgStore::builder_with_pool(pool.clone()).max_connections(50),
                "max_connections",
            ),
            (
                PgStore::builder_with_pool(pool.clone()).connect_timeout(Duration::from_secs(1)),
                "connect_timeout",
            ),
        ] {
            let e = builder.connect().await.unwrap_err();
            assert_eq!(e.kind(), outbox_api::ErrorKind::Config, "{e}");
            assert!(e.to_string().contains(field), "{e}");
            assert!(!e.to_string().contains("secretpw"), "{e}");
        }
    }
}
