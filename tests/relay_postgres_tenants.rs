//! The relay rules of `docs/rules.md` for an outbox in a fleet on
//! PostgreSQL tenant pools (`PgTenantPools` with a bulk pool, as a
//! fleet's schemas have them): the same test bodies as on memory, each
//! test on a fresh schema, the store's claims after a full one and its
//! large completions running on the bulk pool.

mod semantics;

use std::sync::Arc;

use outbox::ManualClock;
use outbox_postgres::testing::PgUnderTest;

struct PostgresTenant;

impl semantics::Backend for PostgresTenant {
    async fn fresh(clock: Arc<ManualClock>) -> semantics::Fixture {
        Box::new(PgUnderTest::fresh_on_tenant_pools(Some(clock), |b| b).await)
    }
}

semantics_tests!(PostgresTenant, in_a_fleet);
