//! [`PgTenantPools`]: connections for many outbox stores of one database
//! (a fleet's tenant schemas), each store pinned to one small pool so that
//! its statements stay prepared.

use std::sync::Arc;

use outbox_api::{Error, Result};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::builder::PgStoreBuilder;
use crate::error::from_sqlx;
use crate::queue::StatementQueue;
use crate::schema::fnv1a;
use crate::store::PgStore;

/// How many prepared statements each connection keeps: a few per store
/// for the stores pinned to it (claim, completion, failure, release, the
/// floor's and the backlog's), with room to spare.
pub const TENANT_STATEMENT_CACHE: usize = 1_024;

/// How many prepared statements each connection of the bulk pool keeps
/// (sqlx's default).
const BULK_STATEMENT_CACHE: usize = 100;

/// Small pools of one database for many stores, each store pinned by
/// name to one of them.
///
/// Every store has statements of its own (its table is in their text), and
/// PostgreSQL plans a statement when a connection first prepares it. With
/// one pool for a thousand tenants, each connection would need every
/// tenant's statements: its cache (100 by default) keeps a few of them, and
/// nearly every claim is parsed and planned again, which was most of the
/// server's work in the tenants bench. Pinned, a connection prepares the
/// statements of its own share of the tenants once and keeps them
/// ([`TENANT_STATEMENT_CACHE`] a connection).
///
/// Its connections are the stores' own: each runs under the claim's
/// settings for its whole session (no sort, bitmap or sequential scan, the
/// generic plan, no JIT, a 10 s lock timeout), so that a claim is one
/// statement, its own transaction: one round trip instead of three
/// (`BEGIN` with the settings, the claim, `COMMIT`), on connections that
/// serve a hundred stores each. Give the application's own statements a
/// pool of their own.
///
/// The cost is on the server: about 200 KB a prepared claim a connection
/// (`pg_backend_memory_contexts`), so about 200 MB for 1,000 tenants on
/// pools of one connection, twice that on pools of two. A store uses its
/// own pool's connections only: a tenant's long statement holds up the
/// others of its pool, not the rest — unless the pools have a
/// [bulk pool](Self::with_bulk_pool), where a store's large statements
/// run, so that a tenant draining a backlog does not hold up the quiet
/// tenants pinned with it. Make stores with [`builder`](Self::builder).
/// Cloning shares the pools.
#[derive(Clone, Debug)]
pub struct PgTenantPools {
    pools: Arc<[PgPool]>,
    /// The queue of each pool's claims and completions.
    queues: Arc<[Arc<StatementQueue>]>,
    bulk: Option<PgPool>,
}

impl PgTenantPools {
    /// `pools` pools of `connections` each to the database of `options`
    /// (each connection keeping [`TENANT_STATEMENT_CACHE`] statements),
    /// connected lazily. A count of zero is a configuration error naming
    /// it.
    pub fn connect_lazy(options: PgConnectOptions, pools: usize, connections: u32) -> Result<Self> {
        if pools == 0 || connections == 0 {
            return Err(Error::config(
                "PgTenantPools",
                format!(
                    "needs at least one pool of at least one connection \
                     (got {pools} pools of {connections})"
                ),
            ));
        }
        let options = crate::claim_sql::with_claim_settings(
            options.statement_cache_capacity(TENANT_STATEMENT_CACHE),
        );
        let pools: Arc<[PgPool]> = (0..pools)
            .map(|_| tenant_pool(connections, options.clone()))
            .collect();
        let queues = pools.iter().cloned().map(StatementQueue::new).collect();
        Ok(PgTenantPools {
            pools,
            queues,
            bulk: None,
        })
    }

    /// These pools and a bulk pool of `connections`, with the same options
    /// (connected lazily), for the large statements of every store made
    /// with [`builder`](Self::builder): its claims, completions and
    /// backlog counts while its last claim came back full (it is draining
    /// a backlog), a completion of [`BULK_ROWS`](crate::BULK_ROWS)
    /// messages or more, and the statements whose cost grows with the
    /// completed messages kept (the stats' count of them, the purge).
    /// Tenants draining backlogs take turns on it, so give it as many
    /// connections as tenants that may drain at once at full speed; a
    /// store's small statements stay on its pinned pool. Zero connections
    /// is a configuration error naming it.
    pub fn with_bulk_pool(self, connections: u32) -> Result<Self> {
        if connections == 0 {
            return Err(Error::config(
                "PgTenantPools::with_bulk_pool",
                "needs at least one connection (got 0)",
            ));
        }
        // sqlx's default cache: the draining tenants' statements stay
        // prepared; every tenant's stats and purges, rare, would not stay
        // in a cache of any sensible size.
        let options = (*self.pools[0].connect_options())
            .clone()
            .statement_cache_capacity(BULK_STATEMENT_CACHE);
        let bulk = tenant_pool(connections, options);
        Ok(PgTenantPools {
            bulk: Some(bulk),
            ..self
        })
    }

    /// [`connect_lazy`](Self::connect_lazy), then one connection of the
    /// first pool made now, so that an unreachable database is an error
    /// here.
    pub async fn connect(
        options: PgConnectOptions,
        pools: usize,
        connections: u32,
    ) -> Result<Self> {
        let made = Self::connect_lazy(options, pools, connections)?;
        made.pools[0]
            .acquire()
            .await
            .map_err(|e| from_sqlx(e, "connecting the tenant pools", "the tenants' database"))?;
        Ok(made)
    }

    /// The pool of the store named `name` (its schema, say): always the same
    /// one for a name, the names spread evenly over the pools.
    pub fn for_name(&self, name: &str) -> &PgPool {
        &self.pools[self.index_of(name)]
    }

    /// The index of the pool of `name`. Stable across processes and
    /// releases, unlike the standard library's hasher.
    fn index_of(&self, name: &str) -> usize {
        (fnv1a(name) % self.pools.len() as u64) as usize
    }

    /// Every pinned pool, in order.
    pub fn pools(&self) -> &[PgPool] {
        &self.pools
    }

    /// The bulk pool, if [`with_bulk_pool`](Self::with_bulk_pool) made one.
    pub fn bulk(&self) -> Option<&PgPool> {
        self.bulk.as_ref()
    }

    /// A builder for the store named `name` (its schema, say, which the
    /// builder does not set): on the pool [`for_name`](Self::for_name)
    /// gives, its large statements on the bulk pool if there is one.
    pub fn builder(&self, name: &str) -> PgStoreBuilder {
        let i = self.index_of(name);
        let mut builder = PgStore::builder_with_pool(self.pools[i].clone());
        builder.bulk = self.bulk.clone();
        builder.queue = Some(Arc::clone(&self.queues[i]));
        builder
    }
}

/// A lazily connected pool of `connections` with `options` (which carry
/// the claim's settings).
fn tenant_pool(connections: u32, options: PgConnectOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        // As the store's own pool: a broken connection surfaces as an error
        // on use, and the relay retries. sqlx's default pings before every
        // acquire, a round trip per statement on connections that serve a
        // hundred stores.
        .test_before_acquire(false)
        .connect_lazy_with(options)
}
