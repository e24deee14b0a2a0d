//! The model-based property test on the PostgreSQL backend, each case on a
//! fresh schema, with the claim's floor stepping after every claim (so that
//! every operation runs against a floor that moved as far as it may), and
//! in about half the cases on connections with the claim's settings for
//! their session (as `PgTenantPools`' are), where a claim is one statement.

mod model;

use outbox_postgres::testing::PgUnderTest;
use proptest::prelude::*;

proptest! {
    #![proptest_config(model::config())]
    #[test]
    fn relay_keeps_its_guarantees_on_postgres(
        batch_size in 1usize..6,
        in_session in any::<bool>(),
        ops in model::ops(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let clock = model::clock();
            let adjust = |b: outbox_postgres::PgStoreBuilder| {
                b.claim_floor_step(std::time::Duration::ZERO)
            };
            let sut = if in_session {
                PgUnderTest::fresh_claiming_in_session_with(Some(clock.clone()), adjust).await
            } else {
                PgUnderTest::fresh_with(Some(clock.clone()), adjust).await
            };
            assert_eq!(sut.pg().claims_in_one_statement(), in_session);
            model::run_case(Box::new(sut), clock, batch_size, ops).await;
        });
    }
}
