//! The model-based property test on the PostgreSQL backend, each case on a
//! fresh schema, with the claim's floor stepping after every claim (so that
//! every operation runs against a floor that moved as far as it may), its
//! store on one of three kinds of pool: a pool of its own (`PgStore::builder`,
//! a claim is one statement); a pool of the application's (its connections
//! keep their settings, so a claim is `BEGIN` with the claim's settings, the
//! claim and `COMMIT`); or `PgTenantPools` with a bulk pool, as a fleet's
//! stores are: a claim is one statement, and a store whose last claim came
//! back full (common at these batch sizes) claims and completes on the bulk
//! pool.

mod model;

use outbox_postgres::testing::PgUnderTest;
use proptest::prelude::*;

proptest! {
    #![proptest_config(model::config())]
    #[test]
    fn relay_keeps_its_guarantees_on_postgres(
        batch_size in 1usize..6,
        pool in 0u8..3,
        ops in model::ops(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let clock = model::clock();
            let adjust = |b: outbox_postgres::PgStoreBuilder| {
                b.claim_floor_step(std::time::Duration::ZERO)
            };
            let (sut, one_statement) = match pool {
                0 => (PgUnderTest::fresh_with(Some(clock.clone()), adjust).await, true),
                1 => (
                    PgUnderTest::fresh_on_application_pool_with(Some(clock.clone()), adjust).await,
                    false,
                ),
                _ => (PgUnderTest::fresh_on_tenant_pools(Some(clock.clone()), adjust).await, true),
            };
            assert_eq!(sut.pg().claims_in_one_statement(), one_statement);
            model::run_case(Box::new(sut), clock, batch_size, ops).await;
        });
    }
}
