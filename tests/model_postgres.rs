//! The model-based property test on the PostgreSQL backend, each case on a
//! fresh schema, with the claim's floor stepping after every claim (so that
//! every operation runs against a floor that moved as far as it may), and
//! in about half the cases on `PgTenantPools` with a bulk pool, as a
//! fleet's stores are: a claim is one statement, and a store whose last
//! claim came back full (common at these batch sizes) claims and completes
//! on the bulk pool.

mod model;

use outbox_postgres::testing::PgUnderTest;
use proptest::prelude::*;

proptest! {
    #![proptest_config(model::config())]
    #[test]
    fn relay_keeps_its_guarantees_on_postgres(
        batch_size in 1usize..6,
        tenant_pools in any::<bool>(),
        ops in model::ops(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let clock = model::clock();
            let adjust = |b: outbox_postgres::PgStoreBuilder| {
                b.claim_floor_step(std::time::Duration::ZERO)
            };
            let sut = if tenant_pools {
                PgUnderTest::fresh_on_tenant_pools(Some(clock.clone()), adjust).await
            } else {
                PgUnderTest::fresh_with(Some(clock.clone()), adjust).await
            };
            assert_eq!(sut.pg().claims_in_one_statement(), tenant_pools);
            model::run_case(Box::new(sut), clock, batch_size, ops).await;
        });
    }
}
