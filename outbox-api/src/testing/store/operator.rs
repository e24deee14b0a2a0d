//! Conformance of the operator's view of a store: stats, purge, and the
//! [`OperatorStore`] list / get / retry / discard.

use super::*;

/// Stats count each state and report the oldest pending message.
pub async fn stats_count_states(s: &dyn StoreUnderTest) {
    let empty = s.store().stats().await.unwrap();
    assert_eq!(
        (
            empty.pending,
            empty.poisoned,
            empty.processed,
            empty.oldest_pending_created_at
        ),
        (0, 0, 0, None)
    );
    let k = s.enqueue(vec![domain(1), domain(2), domain(3)]).await;
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w", 2, now)).await.unwrap();
    s.store().complete(&k[..1], now).await.unwrap();
    s.store().fail(&failure("w", k[1], now, 1)).await.unwrap();
    let st = s.store().stats().await.unwrap();
    assert_eq!((st.pending, st.poisoned, st.processed), (1, 1, 1));
    assert_eq!(
        st.oldest_pending_created_at,
        Some(get(s, k[2]).await.created_at)
    );
    assert_eq!(
        s.store().backlog().await.unwrap(),
        crate::Backlog::from(st),
        "the backlog agrees with the stats"
    );
    assert_eq!(
        crate::Backlog::from(empty),
        crate::Backlog::default(),
        "an empty table has no backlog"
    );
}

/// Purge deletes processed messages older than the cut-off, at most `limit` a call.
pub async fn purge_removes_old_processed_in_batches(s: &dyn StoreUnderTest) {
    let k = s.enqueue((0..5).map(domain).collect()).await;
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w", 4, now)).await.unwrap();
    s.store().complete(&k[..3], now).await.unwrap();
    s.store().fail(&failure("w", k[3], now, 1)).await.unwrap();
    assert_eq!(
        s.store().purge_processed(now, 10).await.unwrap(),
        0,
        "not older than the cut-off"
    );
    let cut = now.saturating_add(Duration::from_millis(1));
    assert_eq!(s.store().purge_processed(cut, 2).await.unwrap(), 2);
    assert_eq!(s.store().purge_processed(cut, 2).await.unwrap(), 1);
    assert_eq!(s.store().purge_processed(cut, 2).await.unwrap(), 0);
    let st = s.store().stats().await.unwrap();
    assert_eq!(
        (st.pending, st.poisoned, st.processed),
        (1, 1, 0),
        "pending and poison are never purged"
    );
}

/// Operators list, inspect, retry and discard.
pub async fn operator_list_get_retry_discard(s: &dyn StoreUnderTest) {
    let other = NewMessage::new(MessageKind::Domain, "Other", b"o".to_vec());
    let k = s.enqueue(vec![domain(1), domain(2), other]).await;
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w", 1, now)).await.unwrap();
    s.store().fail(&failure("w", k[0], now, 1)).await.unwrap();
    let store = s.store();
    let poisoned = store
        .list(&ListQuery {
            state: Some(MessageState::Poisoned),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(&poisoned), [k[0]]);
    let of_type = store
        .list(&ListQuery {
            message_type: Some("Other".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(&of_type), [k[2]]);
    let limited = store
        .list(&ListQuery {
            limit: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(&limited), k[..2]);
    let second_page = store
        .list(&ListQuery::new().offset(1).limit(1))
        .await
        .unwrap();
    assert_eq!(ids(&second_page), [k[1]], "offset skips the oldest");
    let past_the_end = store.list(&ListQuery::new().offset(3)).await.unwrap();
    assert!(
        past_the_end.is_empty(),
        "an offset past the end lists nothing"
    );
    assert!(store.get(MessageId::new()).await.unwrap().is_none());

    let err = store.retry(k[1], "ops", now).await.unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::Conflict,
        "only poisoned messages are retried: {err}"
    );
    assert_eq!(
        store
            .retry(MessageId::new(), "ops", now)
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::NotFound
    );
    store.retry(k[0], "ops", now).await.unwrap();
    let m = get(s, k[0]).await;
    assert_eq!((m.state, m.attempts), (MessageState::Pending, 0));
    let note = m.last_error.unwrap();
    assert!(
        note.contains("retried by ops") && note.contains("handler said no"),
        "{note}"
    );
    assert_eq!(ids(&store.claim(&req("w", 1, now)).await.unwrap()), [k[0]]);

    store.discard(k[1], "ops", now).await.unwrap();
    let m = get(s, k[1]).await;
    assert_eq!(m.state, MessageState::Processed);
    assert!(m.last_error.unwrap().contains("discarded by ops"));
    assert_eq!(
        store.discard(k[1], "ops", now).await.unwrap_err().kind(),
        ErrorKind::Conflict
    );
}

/// A list by trace id gives exactly the messages whose `trace_parent`
/// carries that trace, in commit order, whatever their state; with the
/// other filters too.
pub async fn list_filters_by_trace(s: &dyn StoreUnderTest) {
    const A: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const B: &str = "0af7651916cd43dd8448eb211c80319c";
    let traced =
        |n: usize, trace: &str, span: &str| domain(n).trace_parent(format!("00-{trace}-{span}-01"));
    let k = s
        .enqueue(vec![
            traced(1, A, "00f067aa0ba902b7"),
            traced(2, B, "00f067aa0ba902b7"),
            domain(3),
            traced(4, A, "b7ad6b7169203331"),
        ])
        .await;
    let now = t0().saturating_add(Duration::from_secs(1));
    s.store().claim(&req("w", 1, now)).await.unwrap();
    s.store().complete(&k[..1], now).await.unwrap();
    let listed = |q: ListQuery| async move { ids(&s.store().list(&q).await.unwrap()) };
    assert_eq!(
        listed(ListQuery::new().trace_id(A)).await,
        vec![k[0], k[3]],
        "both messages of trace A, processed and pending, in commit order"
    );
    assert_eq!(listed(ListQuery::new().trace_id(B)).await, vec![k[1]]);
    assert_eq!(
        listed(ListQuery::new().trace_id(A).state(MessageState::Pending)).await,
        vec![k[3]],
        "with a state"
    );
    assert!(
        listed(ListQuery::new().trace_id("1af7651916cd43dd8448eb211c80319c"))
            .await
            .is_empty(),
        "no message of another trace"
    );
    assert_eq!(
        listed(ListQuery::new()).await.len(),
        4,
        "no trace filter: all"
    );
}

/// The activity of a window, bucket by bucket: deliveries and their
/// latency, failures and poisonings by the time given to `fail`, the
/// backlog at each bucket's end.
pub async fn activity_counts_deliveries_failures_and_backlog(s: &dyn StoreUnderTest) {
    let k = s.enqueue((0..5).map(domain).collect()).await;
    let c0 = get(s, k[0]).await.created_at;
    let at = |ms: u64| c0.saturating_add(Duration::from_millis(ms));
    // Six buckets of 10 s from 20 s before the commit: committed in
    // bucket 2, delivered in bucket 2 after 1.5 s, failed in bucket 3.
    let minute_to = |until| {
        crate::activity::ActivityWindow::last(
            Duration::from_secs(60),
            Duration::from_secs(10),
            until,
        )
        .unwrap()
    };
    let window = minute_to(at(40_000));
    let empty = s.store().activity(&window).await.unwrap();
    assert_eq!(empty.buckets.len(), 6);
    s.store().claim(&req("w", 4, at(1_000))).await.unwrap();
    s.store().complete(&k[..2], at(1_500)).await.unwrap();
    s.store()
        .fail(&failure("w", k[2], at(15_000), 1))
        .await
        .unwrap();
    s.store()
        .fail(&failure("w", k[3], at(15_000), 5))
        .await
        .unwrap();
    let a = s.store().activity(&window).await.unwrap();
    let rows: Vec<(u64, u64, u64, u64)> = a
        .buckets
        .iter()
        .map(|b| (b.delivered, b.failed, b.poisoned, b.backlog))
        .collect();
    assert_eq!(
        rows,
        vec![
            (0, 0, 0, 0),
            (0, 0, 0, 0),
            (2, 0, 0, 3),
            (0, 2, 1, 2),
            (0, 0, 0, 2),
            (0, 0, 0, 2)
        ],
        "(delivered, failed, poisoned, backlog) per bucket"
    );
    assert_eq!(
        a.buckets[2].latency_quantile(0.5),
        Some(2_000),
        "commit → processed took 1.5 s: the class up to 2 s"
    );
    assert_eq!(a.buckets[3].latency_quantile(0.5), None);
    assert_eq!(
        a.buckets[0].start.as_millis(),
        c0.as_millis() - 20_000,
        "buckets start at the window's start"
    );
    // A later window: the deliveries are before it; what is waiting
    // still is the backlog all along.
    let later = minute_to(at(100_000));
    let a = s.store().activity(&later).await.unwrap();
    assert!(
        a.buckets
            .iter()
            .all(|b| b.delivered == 0 && b.failed == 0 && b.backlog == 2),
        "{a:#?}"
    );
}
