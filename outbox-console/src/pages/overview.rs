//! The overview: every outbox's health and counts, a line on top counting
//! the outboxes by status and naming those that are not healthy, a filter
//! by name and status, and pages — so that it stays usable with a fleet of
//! a thousand tenants' outboxes.

use outbox_api::Backlog;

use super::*;

/// Longest name filter accepted, in bytes (an outbox name is at most 64).
const MAX_QUERY_LEN: usize = 64;

/// An outbox's status on the overview: its health, or `Unavailable` when
/// its store did not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Status {
    Healthy,
    Degraded,
    Unhealthy,
    Unavailable,
}

impl Status {
    /// Best first.
    const ALL: [Status; 4] = [
        Status::Healthy,
        Status::Degraded,
        Status::Unhealthy,
        Status::Unavailable,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Status::Healthy => "healthy",
            Status::Degraded => "degraded",
            Status::Unhealthy => "unhealthy",
            Status::Unavailable => "unavailable",
        }
    }

    fn from_health(h: HealthStatus) -> Status {
        match h {
            HealthStatus::Healthy => Status::Healthy,
            HealthStatus::Degraded => Status::Degraded,
            HealthStatus::Unhealthy => Status::Unhealthy,
        }
    }
}

/// Which outboxes the overview lists (`?status=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StatusFilter {
    /// Every status (no parameter, or `all`).
    All,
    /// Degraded, unhealthy and unavailable (`not-healthy`).
    NotHealthy,
    /// One status (`healthy`, `degraded`, `unhealthy`, `unavailable`).
    Only(Status),
}

impl StatusFilter {
    /// The filter a `status` parameter names; `None` if it names none.
    fn parse(param: Option<&str>) -> Option<StatusFilter> {
        match param {
            None | Some("all") => Some(StatusFilter::All),
            Some("not-healthy") => Some(StatusFilter::NotHealthy),
            Some(s) => Status::ALL
                .into_iter()
                .find(|status| status.as_str() == s)
                .map(StatusFilter::Only),
        }
    }

    /// The parameter's value (`None` for every status).
    fn param(self) -> Option<&'static str> {
        match self {
            StatusFilter::All => None,
            StatusFilter::NotHealthy => Some("not-healthy"),
            StatusFilter::Only(s) => Some(s.as_str()),
        }
    }

    fn admits(self, s: Status) -> bool {
        match self {
            StatusFilter::All => true,
            StatusFilter::NotHealthy => s != Status::Healthy,
            StatusFilter::Only(only) => s == only,
        }
    }
}

/// What the first pass over every outbox learns: its status and why.
struct Judged<'a> {
    outbox: &'a Outbox,
    status: Status,
    /// Why it is not healthy; for `Unavailable`, the store's error.
    reasons: Vec<String>,
    /// Whether the status is a relay's own report (else judged from the
    /// table).
    from_relay: bool,
}

/// Health from the table alone: poison and backlog age
/// ([`outbox_api::backlog_reasons`], as the relay and `outbox health` say it).
fn table_health(backlog: &Backlog, alert: Duration, now: Timestamp) -> (HealthStatus, Vec<String>) {
    let reasons = outbox_api::backlog_reasons(backlog, alert, now);
    let status = if reasons.is_empty() {
        HealthStatus::Healthy
    } else {
        HealthStatus::Degraded
    };
    (status, reasons)
}

/// The status of `o`: its relay's report if it has one, else what its
/// backlog says (the backlog only: a status never counts the processed
/// history).
async fn judge(o: &Outbox, alert: Duration) -> Judged<'_> {
    if let Some(report) = &o.health {
        let r = report().await;
        return Judged {
            outbox: o,
            status: Status::from_health(r.status),
            reasons: r.reasons,
            from_relay: true,
        };
    }
    match o.store.backlog().await {
        Ok(backlog) => {
            let (status, reasons) = table_health(&backlog, alert, Timestamp::now());
            Judged {
                outbox: o,
                status: Status::from_health(status),
                reasons,
                from_relay: false,
            }
        }
        Err(e) => Judged {
            outbox: o,
            status: Status::Unavailable,
            reasons: vec![e.to_string()],
            from_relay: false,
        },
    }
}

/// The overview's address with a filter and a page.
fn overview_url(st: &State, q: Option<&str>, filter: StatusFilter, page: usize) -> String {
    let mut params = form_urlencoded::Serializer::new(String::new());
    if let Some(q) = q {
        params.append_pair("q", q);
    }
    if let Some(status) = filter.param() {
        params.append_pair("status", status);
    }
    if page > 1 {
        params.append_pair("page", &page.to_string());
    }
    let params = params.finish();
    if params.is_empty() {
        st.home()
    } else {
        format!("{}?{params}", st.home())
    }
}

/// One status on the summary line: how many outboxes have it, and the
/// names of the first of them.
struct Tally<'a> {
    status: Status,
    count: usize,
    named: Vec<&'a str>,
}

/// The outboxes counted by status, best first, statuses no outbox has
/// left out; at most [`view::NAMES_SHOWN`] of the outboxes that are not
/// healthy are named, the worst statuses first.
fn tally<'a>(judged: &[Judged<'a>]) -> Vec<Tally<'a>> {
    let mut tallies: Vec<Tally<'a>> = Status::ALL
        .into_iter()
        .map(|status| Tally {
            status,
            count: judged.iter().filter(|j| j.status == status).count(),
            named: Vec::new(),
        })
        .filter(|t| t.count > 0)
        .collect();
    let mut budget = view::NAMES_SHOWN;
    for t in tallies.iter_mut().rev() {
        if t.status == Status::Healthy {
            continue;
        }
        t.named = judged
            .iter()
            .filter(|j| j.status == t.status)
            .take(budget)
            .map(|j| j.outbox.name.as_str())
            .collect();
        budget -= t.named.len();
    }
    tallies
}

/// `GET {prefix}/?q=&status=&page=`: one row per outbox, filtered by a
/// part of the name (`q`, any case) and by status (`status`: `healthy`,
/// `degraded`, `unhealthy`, `unavailable`, or `not-healthy` for the last
/// three), a page of them at a time; above them every outbox counted by
/// status, and the names of those that are not healthy.
pub(crate) async fn overview(S(st): S<Arc<State>>, RawQuery(raw): RawQuery) -> Page {
    let ps = params(raw.as_deref());
    let q = param(&ps, "q").map(str::trim).filter(|q| !q.is_empty());
    if q.is_some_and(|q| q.len() > MAX_QUERY_LEN) {
        return Err(st.bad_request(&format!(
            "The name filter (q) is at most {MAX_QUERY_LEN} bytes long: no outbox name is longer."
        )));
    }
    let filter = StatusFilter::parse(param(&ps, "status")).ok_or_else(|| {
        st.bad_request(
            "status must be healthy, degraded, unhealthy, unavailable, not-healthy or all.",
        )
    })?;
    let size = st.page_size;
    // Past the filtered list's end is a 404 below; this bounds the number.
    let page_no = page_number(&st, &ps, (MAX_LISTED / size).max(1))?;

    // Every outbox's status, a few at a time: the counts on top are of all.
    let alert = st.backlog_age_alert;
    let outboxes = st.outboxes();
    let judged = each_bounded(st.read_concurrency, outboxes.iter(), |o| judge(o, alert)).await;
    let needle = q.map(str::to_ascii_lowercase);
    let matching: Vec<&Judged<'_>> = judged
        .iter()
        .filter(|j| filter.admits(j.status))
        .filter(|j| {
            needle
                .as_deref()
                .is_none_or(|n| j.outbox.name.to_ascii_lowercase().contains(n))
        })
        .collect();
    let pages = matching.len().div_ceil(size).max(1);
    if page_no > pages {
        return Err(error_page(
            &st,
            StatusCode::NOT_FOUND,
            "Past the last page",
            &format!(
                "Page {page_no} is past the last: {} outbox(es) match, {size} a page.",
                matching.len()
            ),
        ));
    }
    let first = (page_no - 1) * size;
    let shown = &matching[first..matching.len().min(first + size)];
    // The counts of the page's outboxes only (they count the processed
    // history, which the status does not need).
    let stats = each_bounded(st.read_concurrency, shown, |j| async move {
        if j.status == Status::Unavailable {
            None
        } else {
            Some(j.outbox.store.stats().await)
        }
    })
    .await;
    let now = Timestamp::now();
    let filtered = q.is_some() || filter != StatusFilter::All;
    let tallies = tally(&judged);
    let body = html! {
        h1 { "Overview" }
        @if outboxes.is_empty() {
            p.note { "This console shows no outbox (it was started without one, or every one was removed)." }
        } @else {
            p.summary {
                (outboxes.len()) @if outboxes.len() == 1 { " outbox: " } @else { " outboxes: " }
                @for (i, t) in tallies.iter().enumerate() {
                    @if i > 0 { ", " }
                    a href=(overview_url(&st, None, StatusFilter::Only(t.status), 1)) {
                        (t.count) " " span class={ "status " (t.status.as_str()) } { (t.status.as_str()) }
                    }
                    @if !t.named.is_empty() {
                        " ("
                        @for (k, name) in t.named.iter().enumerate() {
                            @if k > 0 { ", " }
                            a href=(st.list_url(name, "poisoned", None, 1)) { (name) }
                        }
                        @if t.count > t.named.len() {
                            " and "
                            a href=(overview_url(&st, None, StatusFilter::Only(t.status), 1)) {
                                (t.count - t.named.len()) " more"
                            }
                        }
                        ")"
                    }
                }
            }
            form.filter method="get" action=(st.home()) {
                label { "Name contains "
                    input type="search" name="q" value=[q] placeholder="any name" maxlength=(MAX_QUERY_LEN);
                }
                label { "Status "
                    select name="status" {
                        option value="all" selected[filter == StatusFilter::All] { "any" }
                        option value="not-healthy" selected[filter == StatusFilter::NotHealthy] { "not healthy" }
                        @for s in Status::ALL {
                            option value=(s.as_str()) selected[filter == StatusFilter::Only(s)] { (s.as_str()) }
                        }
                    }
                }
                button type="submit" { "Filter" }
                @if filtered { " " a href=(st.home()) { "clear filter" } }
            }
            @if matching.is_empty() {
                p.note { "No outbox matches the filter." }
            } @else {
                @if filtered || pages > 1 {
                    p.note {
                        "Outboxes " (first + 1) "–" (first + shown.len()) " of " (matching.len())
                        @if filtered { " matching the filter" } "."
                    }
                }
                table {
                    thead { tr {
                        th { "outbox" } th { "health" } th.num { "pending" } th.num { "poisoned" }
                        th.num { "processed" } th { "oldest pending" }
                    } }
                    tbody {
                        @for (j, stats) in shown.iter().zip(&stats) {
                            @let o = j.outbox;
                            @match stats {
                                Some(Ok(s)) => {
                                    tr {
                                        td {
                                            a href=(st.list_url(&o.name, "poisoned", None, 1)) { (o.name) }
                                            br; a.note href=(st.activity_url(&o.name)) { "activity" }
                                        }
                                        td {
                                            span class={ "status " (j.status.as_str()) } { (j.status.as_str()) }
                                            @if !j.from_relay { " " span.note { "(from the table)" } }
                                            @for r in &j.reasons { br; span.note { (r) } }
                                        }
                                        td.num { a href=(st.list_url(&o.name, "pending", None, 1)) { (s.pending) } }
                                        td.num { a href=(st.list_url(&o.name, "poisoned", None, 1)) { (s.poisoned) } }
                                        td.num { a href=(st.list_url(&o.name, "processed", None, 1)) { (s.processed) } }
                                        td { @match s.oldest_pending_created_at {
                                            Some(t) => { (view::age(now.since(t))) }
                                            None => { "—" }
                                        } }
                                    }
                                }
                                _ => {
                                    @let error = match stats {
                                        Some(Err(e)) => e.to_string(),
                                        _ => j.reasons.join("; "),
                                    };
                                    tr {
                                        td { (o.name) }
                                        td colspan="5" {
                                            span class="status unavailable" { "unavailable" }
                                            " " span.error { (error) }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                @if pages > 1 {
                    p.pager {
                        @if page_no > 1 { a href=(overview_url(&st, q, filter, page_no - 1)) { "← previous page" } }
                        span.note { "page " (page_no) " of " (pages) }
                        @if page_no < pages { " " a href=(overview_url(&st, q, filter, page_no + 1)) { "next page →" } }
                    }
                }
            }
            p.note { "Counted at " (now) ". Health \"from the table\" is judged from poison and the \
                      age of the oldest pending message; a relay's own report also knows whether \
                      it runs and whether its transport is up." }
        }
    };
    Ok(respond(StatusCode::OK, page(&st, "Overview", body)))
}

#[cfg(test)]
mod tests {
    use outbox_api::Stats;

    use super::*;

    #[test]
    fn table_health_names_poison_and_age() {
        let now = Timestamp::from_millis(1_000_000);
        let ok = Stats::new(3, 0, 9, Some(now.saturating_sub(Duration::from_secs(10))));
        assert_eq!(
            table_health(&ok.into(), Duration::from_secs(300), now).0,
            HealthStatus::Healthy
        );
        let old = Stats::new(3, 1, 9, Some(now.saturating_sub(Duration::from_secs(600))));
        let (s, reasons) = table_health(&old.into(), Duration::from_secs(300), now);
        assert_eq!(s, HealthStatus::Degraded);
        assert_eq!(reasons.len(), 2, "{reasons:?}");
    }

    #[test]
    fn status_filters() {
        assert_eq!(StatusFilter::parse(None), Some(StatusFilter::All));
        assert_eq!(StatusFilter::parse(Some("all")), Some(StatusFilter::All));
        let not_healthy = StatusFilter::parse(Some("not-healthy")).unwrap();
        assert!(!not_healthy.admits(Status::Healthy));
        for s in [Status::Degraded, Status::Unhealthy, Status::Unavailable] {
            assert!(not_healthy.admits(s));
            assert_eq!(
                StatusFilter::parse(Some(s.as_str())),
                Some(StatusFilter::Only(s))
            );
        }
        assert_eq!(StatusFilter::parse(Some("sick")), None);
        assert_eq!(StatusFilter::parse(Some("Healthy")), None);
    }
}
