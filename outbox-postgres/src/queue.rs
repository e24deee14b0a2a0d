//! The claims and completions of the stores pinned to one of
//! [`PgTenantPools`]' pools, run back to back on one connection.
//!
//! Through the pool, each statement would cost more than its own round
//! trip: sqlx returns a connection to its pool from a task spawned for it,
//! which pings the server first, and then wakes the next task waiting for
//! it, which must itself be scheduled before it sends anything. On a pool of
//! one connection serving a hundred stores, those hops are the connection's
//! busy time, not the statements: with the machine's cores taken by the
//! database, the quiet tenants' claims queued for the connection for
//! hundreds of milliseconds while it sat idle (docs/performance.md,
//! "Tenants: where a quiet message waits").
//!
//! A [`StatementQueue`] takes the statements as jobs instead. One task
//! acquires the connection, runs the jobs queued, in order, each as soon as
//! the last has answered, and gives the connection back when none is left or
//! after [`RUN`] jobs, so that the pool's other statements (failures,
//! releases, counts) get their turn. A job's caller awaits its answer; a
//! caller that stops waiting does not stop its job, which runs as the
//! pool's statement would have, once sent.
//!
//! [`PgTenantPools`]: crate::PgTenantPools

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A boxed future, sent between threads, borrowing for `'a`.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Statements to run on a connection, with their answer: what a caller
/// gives [`StatementQueue::run`] (and what a store runs on a connection of
/// its pool when it has no queue).
pub(crate) trait OnConnection<T>:
    for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, std::result::Result<T, sqlx::Error>>
    + Send
    + 'static
{
}

impl<T, F> OnConnection<T> for F where
    F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, std::result::Result<T, sqlx::Error>>
        + Send
        + 'static
{
}

/// Most jobs run on one acquisition of the connection.
const RUN: usize = 32;

/// A statement (or a few) to run on the connection, or to be told why
/// there is none.
type Job = Box<
    dyn for<'c> FnOnce(std::result::Result<&'c mut PgConnection, String>) -> BoxFuture<'c, ()>
        + Send,
>;

/// The queue of one pool's claims and completions (see the module).
pub(crate) struct StatementQueue {
    pool: PgPool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// The task running the jobs, if one was started and has not said it
    /// is done. One that ended otherwise (its runtime shut down) is
    /// finished, and the next job starts another.
    driver: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StatementQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatementQueue")
            .field("queued", &self.state().jobs.len())
            .finish()
    }
}

impl StatementQueue {
    pub(crate) fn new(pool: PgPool) -> Arc<StatementQueue> {
        Arc::new(StatementQueue {
            pool,
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the pool's connection after the jobs queued before it;
    /// its answer. `Err` also when no connection could be had.
    pub(crate) async fn run<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl OnConnection<T>,
    ) -> std::result::Result<T, sqlx::Error> {
        let (reply, answer) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            Box::pin(async move {
                let result = match conn {
                    Ok(conn) => f(conn).await,
                    Err(reason) => Err(sqlx::Error::Io(std::io::Error::other(reason))),
                };
                // The caller may have stopped waiting.
                let _ = reply.send(result);
            })
        });
        {
            let mut state = self.state();
            state.jobs.push_back(job);
            if state.driver.as_ref().is_none_or(JoinHandle::is_finished) {
                state.driver = Some(tokio::spawn(Arc::clone(self).drive()));
            }
        }
        answer.await.unwrap_or_else(|_| {
            Err(sqlx::Error::Io(std::io::Error::other(
                "the statement queue's task ended before answering",
            )))
        })
    }

    /// Runs the queued jobs until none is left, [`RUN`] at a time on one
    /// acquisition of the connection.
    async fn drive(self: Arc<Self>) {
        let _panicking = Panicking(Arc::clone(&self));
        loop {
            let mut conn = match self.pool.acquire().await {
                Ok(conn) => Some(conn),
                Err(e) => {
                    // Every job queued now is told; later ones try again.
                    let reason = format!("acquiring a connection: {e}");
                    let jobs = std::mem::take(&mut self.state().jobs);
                    for job in jobs {
                        job(Err(reason.clone())).await;
                    }
                    None
                }
            };
            if let Some(conn) = conn.as_mut() {
                for _ in 0..RUN {
                    let Some(job) = self.state().jobs.pop_front() else {
                        break;
                    };
                    job(Ok(&mut **conn)).await;
                }
            }
            drop(conn);
            // Under the lock: a job queued after this look starts a task.
            let mut state = self.state();
            if state.jobs.is_empty() {
                state.driver = None;
                return;
            }
        }
    }
}

/// Starts another task for the jobs left when a job panics (its caller
/// is told the task ended).
struct Panicking(Arc<StatementQueue>);

impl Drop for Panicking {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut state = self.0.state();
        if let (false, Ok(runtime)) = (state.jobs.is_empty(), tokio::runtime::Handle::try_current())
        {
            state.driver = Some(runtime.spawn(Arc::clone(&self.0).drive()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use sqlx::{AssertSqlSafe, Row};

    use super::*;
    use crate::testing::{database_url, unique_schema};

    const DEADLINE: Duration = Duration::from_secs(30);

    fn pool(connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(connections)
            .connect_lazy_with(PgConnectOptions::from_str(&database_url()).unwrap())
    }

    /// `SELECT n` on the queue's connection.
    async fn select(queue: &Arc<StatementQueue>, n: i64) -> sqlx::Result<i64> {
        queue
            .run(move |conn| {
                Box::pin(async move {
                    let row = sqlx::query("SELECT $1::int8")
                        .bind(n)
                        .fetch_one(conn)
                        .await?;
                    Ok(row.get(0))
                })
            })
            .await
    }

    #[tokio::test]
    async fn many_callers_jobs_run_one_at_a_time_in_order_each_answered_with_its_own() {
        // Two connections: the queue still runs one job at a time.
        let queue = StatementQueue::new(pool(2));
        let order: Arc<Mutex<Vec<i64>>> = Arc::default();
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let calls = (0..200).map(|n| {
            let (queue, order, running) =
                (Arc::clone(&queue), Arc::clone(&order), Arc::clone(&running));
            async move {
                let answer = queue
                    .run(move |conn| {
                        Box::pin(async move {
                            order.lock().unwrap().push(n);
                            let others = running.fetch_add(1, SeqCst);
                            assert_eq!(others, 0, "one job at a time");
                            let row = sqlx::query("SELECT $1::int8").bind(n).fetch_one(conn).await;
                            running.fetch_sub(1, SeqCst);
                            Ok(row?.get::<i64, _>(0))
                        })
                    })
                    .await
                    .unwrap();
                assert_eq!(answer, n, "each caller gets its own job's answer");
            }
        });
        tokio::time::timeout(DEADLINE, futures_join(calls))
            .await
            .unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            (0..200).collect::<Vec<_>>(),
            "in the order queued"
        );
    }

    /// Runs every future in `calls` at once, queued in order.
    async fn futures_join<F: Future<Output = ()>>(calls: impl Iterator<Item = F>) {
        let mut started: Vec<Pin<Box<F>>> = calls.map(Box::pin).collect();
        // Poll each once, in order, so that they queue in that order.
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut pending = Vec::new();
        for mut f in started.drain(..) {
            if f.as_mut().poll(&mut cx).is_pending() {
                pending.push(f);
            }
        }
        for f in pending {
            f.await;
        }
    }

    #[tokio::test]
    async fn a_job_whose_caller_stopped_waiting_still_runs() {
        let pool = pool(1);
        let table = unique_schema("queue_cancelled");
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE {table} (n int)")))
            .execute(&pool)
            .await
            .unwrap();
        let queue = StatementQueue::new(pool.clone());
        let insert = format!("INSERT INTO {table} VALUES (1)");
        let mut call = Box::pin(queue.run(move |conn| {
            Box::pin(async move {
                sqlx::raw_sql(AssertSqlSafe(insert)).execute(conn).await?;
                Ok(())
            })
        }));
        // Queued, then given up.
        let waker = std::task::Waker::noop();
        assert!(
            call.as_mut()
                .poll(&mut std::task::Context::from_waker(waker))
                .is_pending()
        );
        drop(call);
        let count = format!("SELECT count(*) FROM {table}");
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let n: i64 = sqlx::query_scalar(AssertSqlSafe(count.as_str()))
                .fetch_one(&pool)
                .await
                .unwrap();
            if n == 1 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the job never ran");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&pool)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn no_connection_is_every_queued_callers_error_and_the_next_job_tries_again() {
        // A port nothing listens on: every acquire fails, quickly.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let options = PgConnectOptions::new().host("127.0.0.1").port(port);
        let queue = StatementQueue::new(
            PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(2))
                .connect_lazy_with(options),
        );
        let calls = (0..3).map(|n| {
            let queue = Arc::clone(&queue);
            async move {
                let e = select(&queue, n).await.unwrap_err();
                assert!(e.to_string().contains("acquiring a connection"), "{e}");
            }
        });
        tokio::time::timeout(DEADLINE, futures_join(calls))
            .await
            .unwrap();
        let e = tokio::time::timeout(DEADLINE, select(&queue, 9))
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.to_string().contains("acquiring a connection"), "{e}");
    }

    #[tokio::test]
    async fn a_job_that_panics_is_its_callers_error_and_the_jobs_behind_it_run() {
        let queue = StatementQueue::new(pool(1));
        let panicking = {
            let queue = Arc::clone(&queue);
            async move {
                let e = queue
                    .run(|_conn| -> BoxFuture<'_, sqlx::Result<()>> {
                        Box::pin(async { panic!("a job panicked") })
                    })
                    .await
                    .unwrap_err();
                assert!(e.to_string().contains("before answering"), "{e}");
            }
        };
        let behind = {
            let queue = Arc::clone(&queue);
            async move {
                assert_eq!(select(&queue, 7).await.unwrap(), 7);
            }
        };
        let both: Vec<Pin<Box<dyn Future<Output = ()> + Send>>> =
            vec![Box::pin(panicking), Box::pin(behind)];
        tokio::time::timeout(DEADLINE, futures_join(both.into_iter()))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn the_pools_other_statements_get_a_turn_while_the_queue_is_busy() {
        let pool = pool(1);
        let queue = StatementQueue::new(pool.clone());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Callers that keep the queue full.
        let busy: Vec<_> = (0..8)
            .map(|c| {
                let (queue, stop) = (Arc::clone(&queue), Arc::clone(&stop));
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        select(&queue, c).await.unwrap();
                    }
                })
            })
            .collect();
        for _ in 0..5 {
            let n: i64 = tokio::time::timeout(
                DEADLINE,
                sqlx::query_scalar("SELECT 5::int8").fetch_one(&pool),
            )
            .await
            .expect("a statement on the pool waits at most a run of the queue")
            .unwrap();
            assert_eq!(n, 5);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for b in busy {
            b.await.unwrap();
        }
    }
}
