//! What happened over time: the saga view of one trace across the
//! outboxes, and one outbox's activity over the last hour.

use outbox_api::activity::ActivityWindow;

use super::*;
use crate::charts;

/// At most this many messages of one trace, per outbox, on the saga view.
const MAX_TRACED: usize = 500;

/// `GET {prefix}/traces/{trace_id}`: every message of one trace (a saga)
/// in every outbox of the console, in the order they were committed, with
/// kind, type, state, attempts and the time from commit to processed — where
/// a saga stopped, without a tracing backend.
pub(crate) async fn trace(S(st): S<Arc<State>>, p: Result<Path<String>, PathRejection>) -> Page {
    let trace_id = path(&st, p)?;
    if !outbox_api::trace::is_trace_id(&trace_id) {
        return Err(st.bad_request(&format!(
            "A trace id is 32 lowercase hex digits, not all zero (got \"{}\").",
            view::short(&trace_id, 64)
        )));
    }
    let mut rows: Vec<(&str, Message)> = Vec::new();
    let mut cut = Vec::new();
    let query = ListQuery::new()
        .trace_id(trace_id.clone())
        .limit(MAX_TRACED + 1);
    // A few outboxes at a time: a console may show a thousand.
    let outboxes = st.outboxes();
    let found = each_bounded(st.read_concurrency, outboxes.iter(), |o| {
        let query = &query;
        async move { (o, o.store.list(query).await) }
    })
    .await;
    for (o, found) in found {
        let mut found =
            found.map_err(|e| st.store_error(&format!("listing outbox \"{}\"", o.name), &e))?;
        if found.len() > MAX_TRACED {
            found.truncate(MAX_TRACED);
            cut.push(o.name.as_str());
        }
        rows.extend(found.into_iter().map(|m| (o.name.as_str(), m)));
    }
    rows.sort_by_key(|(_, m)| m.created_at);
    let now = Timestamp::now();
    let first = rows.first().map(|(_, m)| m.created_at);
    let body = html! {
        h1 { "Trace " code { (trace_id) } }
        p.note {
            "Every message of this trace in " (outboxes.len()) " outbox"
            @if outboxes.len() != 1 { "es" }
            ", in the order they were committed. A processed message is gone once retention purges it."
        }
        @if !cut.is_empty() {
            p.flash { "Only the first " (MAX_TRACED) " messages of: " (cut.join(", ")) "." }
        }
        @if rows.is_empty() {
            p.note { "No message carries this trace." }
        } @else {
            table {
                thead { tr {
                    th { "committed" } th { "outbox" } th { "kind" } th { "type" } th { "state" }
                    th.num { "attempts" } th { "commit → processed" } th { "last error" }
                } }
                tbody {
                    @for (outbox, m) in &rows {
                        tr {
                            td {
                                a href=(st.message_url(outbox, m.id)) {
                                    @match first {
                                        Some(f) if m.created_at > f => { "+" (view::age(m.created_at.since(f))) }
                                        _ => { (view::age(now.since(m.created_at))) " ago" }
                                    }
                                }
                            }
                            td { (outbox) }
                            td { (m.kind) }
                            td { code { (m.message_type) } }
                            td class=(m.state.as_str()) { (m.state) }
                            td.num { (m.attempts) }
                            td {
                                @match m.processed_at {
                                    Some(t) => { (view::age(t.since(m.created_at))) }
                                    None => { span.note { "not yet" } }
                                }
                            }
                            td { @if let Some(e) = &m.last_error { (view::short(e, 160)) } }
                        }
                    }
                }
            }
        }
    };
    Ok(respond(
        StatusCode::OK,
        page(&st, &format!("Trace {trace_id}"), body),
    ))
}

/// `GET {prefix}/{outbox}/activity`: the last hour minute by minute, as
/// charts.
pub(crate) async fn activity(S(st): S<Arc<State>>, p: Result<Path<String>, PathRejection>) -> Page {
    let name = path(&st, p)?;
    let o = &st.outbox(&name)?;
    let now = Timestamp::now();
    // The window ends just after now: what happened this millisecond counts.
    let until = now.saturating_add(Duration::from_millis(1));
    let window = ActivityWindow::last(ACTIVITY_SPAN, ACTIVITY_BUCKET, until)
        .map_err(|e| st.store_error("counting the activity", &e))?;
    let a = o
        .store
        .activity(&window)
        .await
        .map_err(|e| st.store_error("counting the activity", &e))?;
    let total = |f: fn(&outbox_api::activity::ActivityBucket) -> u64| -> u64 {
        a.buckets.iter().map(f).sum()
    };
    let body = html! {
        h1 { "Activity of " (o.name) ", last hour" }
        p {
            a href=(st.list_url(&o.name, "poisoned", None, 1)) { "messages" }
        }
        p.note {
            (total(|b| b.delivered)) " delivered, " (total(|b| b.failed)) " failed, "
            (total(|b| b.poisoned)) " poisoned in the hour to " (now) ". From the outbox's own rows: \
            what retention purged is not counted; a message that failed several times in a \
            minute counts once, at its last failed try."
        }
        (charts::activity_charts(&a, "60 min ago", "now"))
    };
    Ok(respond(
        StatusCode::OK,
        page(&st, &format!("Activity of {}", o.name), body),
    ))
}

/// How far back the activity page looks, and its bucket.
const ACTIVITY_SPAN: Duration = Duration::from_secs(3_600);
const ACTIVITY_BUCKET: Duration = Duration::from_secs(60);
