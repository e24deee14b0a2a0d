//! The console's pages and actions.
// A refusal is a ready page (`Response`), returned early with `?`; its
// size does not matter on a path that renders HTML.
#![allow(clippy::result_large_err)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{ConnectInfo, Path, RawQuery, State as S};
use axum::http::{Extensions, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use outbox_api::{
    ErrorKind, HealthStatus, ListQuery, Message, MessageId, MessageState, OperatorAction,
    Timestamp, limits,
};

use crate::security::Keys;
use crate::view::{self, error_page, page, respond};
use crate::{Console, Outbox, OutboxList, SESSION_COOKIE};

mod actions;
mod history;
mod login;
mod overview;

pub(crate) use actions::{act_bulk, act_one, confirm_bulk, confirm_one};
pub(crate) use history::{activity, trace};
pub(crate) use login::{login, login_form, logout};
pub(crate) use overview::overview;

/// Furthest a list pages: offsets cost in proportion to their size.
const MAX_LISTED: usize = 1_000_000;
/// Most messages one bulk action touches; the confirmation page says so.
pub(crate) const BULK_MAX: usize = 10_000;

/// What the handlers share.
pub(crate) struct State {
    /// Read through [`State::outboxes`]: it may change while serving.
    outbox_list: OutboxList,
    pub(crate) prefix: String,
    pub(crate) keys: Keys,
    backlog_age_alert: Duration,
    page_size: usize,
    read_concurrency: usize,
}

type Page = Result<Response, Response>;

impl State {
    pub(crate) fn new(console: Console) -> Self {
        State {
            keys: Keys::new(console.token.as_deref()),
            outbox_list: console.outboxes,
            prefix: console.prefix,
            backlog_age_alert: console.backlog_age_alert,
            page_size: console.page_size,
            read_concurrency: console.read_concurrency,
        }
    }

    /// The overview's address.
    pub(crate) fn home(&self) -> String {
        if self.prefix.is_empty() {
            "/".to_owned()
        } else {
            self.prefix.clone()
        }
    }

    /// The outboxes shown now (one page reads one such list).
    pub(crate) fn outboxes(&self) -> Arc<Vec<Outbox>> {
        self.outbox_list.snapshot()
    }

    fn outbox(&self, name: &str) -> Result<Outbox, Response> {
        let outboxes = self.outboxes();
        outboxes
            .iter()
            .find(|o| o.name == name)
            .cloned()
            .ok_or_else(|| {
                let known: Vec<&str> = outboxes.iter().map(|o| o.name.as_str()).collect();
                error_page(
                    self,
                    StatusCode::NOT_FOUND,
                    "No such outbox",
                    &format!(
                        "There is no outbox named \"{}\" here. This console shows: {}.",
                        view::short(name, 64),
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            view::some_names(&known, view::NAMES_SHOWN)
                        }
                    ),
                )
            })
    }

    pub(crate) fn list_url(
        &self,
        outbox: &str,
        state: &str,
        ty: Option<&str>,
        page: usize,
    ) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.append_pair("state", state);
        if let Some(t) = ty {
            q.append_pair("type", t);
        }
        if page > 1 {
            q.append_pair("page", &page.to_string());
        }
        format!("{}/{outbox}/messages?{}", self.prefix, q.finish())
    }

    /// The activity charts of `outbox`.
    pub(crate) fn activity_url(&self, outbox: &str) -> String {
        format!("{}/{outbox}/activity", self.prefix)
    }

    /// The saga view of trace `trace_id`.
    pub(crate) fn trace_url(&self, trace_id: &str) -> String {
        format!("{}/traces/{trace_id}", self.prefix)
    }

    fn message_url(&self, outbox: &str, id: MessageId) -> String {
        format!("{}/{outbox}/messages/{id}", self.prefix)
    }

    fn bad_request(&self, detail: &str) -> Response {
        error_page(self, StatusCode::BAD_REQUEST, "Bad request", detail)
    }

    fn store_error(&self, doing: &str, e: &outbox_api::Error) -> Response {
        let (status, title) = match e.kind() {
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "Not found"),
            ErrorKind::Conflict => (StatusCode::CONFLICT, "Not possible now"),
            ErrorKind::InvalidInput => (StatusCode::BAD_REQUEST, "Bad request"),
            _ => (StatusCode::SERVICE_UNAVAILABLE, "The store did not answer"),
        };
        if status == StatusCode::SERVICE_UNAVAILABLE {
            tracing::warn!(error = %e, "outbox console: {doing} failed");
        }
        error_page(self, status, title, &format!("{doing}: {e}"))
    }
}

/// Runs `read` on each of `items`, at most `n` at a time, and gives the
/// results in the items' order: how a page reads many outboxes without
/// reading them one by one or all at once. (The futures are made first, so
/// that the handler's future holds no closure: axum needs it `Send` for
/// every lifetime.)
pub(crate) fn each_bounded<I, T, F, Fut>(
    n: usize,
    items: I,
    read: F,
) -> impl std::future::Future<Output = Vec<T>>
where
    I: IntoIterator,
    F: FnMut(I::Item) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    use futures_util::StreamExt;
    // In order, at most `n` at a time, inside the caller's task (nothing
    // is spawned, so the reads may borrow).
    let reads: Vec<Fut> = items.into_iter().map(read).collect();
    futures_util::stream::iter(reads)
        .buffered(n.max(1))
        .collect()
}

fn params(q: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(q.unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

fn param<'a>(ps: &'a [(String, String)], name: &str) -> Option<&'a str> {
    ps.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}

/// The `page` parameter: 1 if absent, else a whole number from 1 to
/// `max_page` (a 400 page otherwise).
fn page_number(st: &State, ps: &[(String, String)], max_page: usize) -> Result<usize, Response> {
    match param(ps, "page") {
        None => Ok(1),
        Some(s) => match s.parse::<usize>() {
            Ok(n) if (1..=max_page).contains(&n) => Ok(n),
            _ => Err(st.bad_request(&format!(
                "page must be a whole number from 1 to {max_page} (got \"{}\").",
                view::short(s, 40)
            ))),
        },
    }
}

fn path<T>(state: &State, p: Result<Path<T>, PathRejection>) -> Result<T, Response> {
    p.map(|Path(t)| t)
        .map_err(|e| state.bad_request(&format!("The address is not valid: {e}")))
}

fn parse_id(state: &State, s: &str) -> Result<MessageId, Response> {
    s.parse().map_err(|_| {
        state.bad_request(&format!(
            "\"{}\" is not a message id: ids are UUIDs such as 0190f3c4-5b6a-7c8d-9e0f-112233445566.",
            view::short(s, 80)
        ))
    })
}

fn parse_type(state: &State, t: Option<&str>) -> Result<Option<String>, Response> {
    match t {
        Some(t) if t.len() > limits::MAX_TYPE_LEN => Err(state.bad_request(&format!(
            "A message type is at most {} bytes long.",
            limits::MAX_TYPE_LEN
        ))),
        Some(t) => Ok(Some(t.to_owned())),
        None => Ok(None),
    }
}

/// Who the audit note names: the console and, when known, the peer.
fn operator(ext: &Extensions) -> String {
    match ext.get::<ConnectInfo<SocketAddr>>() {
        Some(ConnectInfo(addr)) => format!("outbox-console ({})", addr.ip()),
        None => "outbox-console".to_owned(),
    }
}

/// `GET {prefix}/style.css`.
pub(crate) async fn stylesheet() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        view::STYLE,
    )
        .into_response()
}

/// Any path under the prefix that is not a page.
pub(crate) async fn not_found(S(st): S<Arc<State>>) -> Response {
    error_page(
        &st,
        StatusCode::NOT_FOUND,
        "Not found",
        "There is no page at this address.",
    )
}

/// The fallback of a console served alone (no state: it is outside the
/// console's router).
pub(crate) fn plain_not_found(prefix: String) -> impl Fn() -> std::future::Ready<Response> + Clone {
    move || {
        let body = html! {
            (maud::DOCTYPE)
            html lang="en" { head { meta charset="utf-8"; title { "Not found · outbox console" } }
            body { h1 { "Not found" } p { "There is no page at this address." }
                   p { a href={ (prefix) "/" } { "Back to the overview" } } } }
        };
        std::future::ready(respond(StatusCode::NOT_FOUND, body))
    }
}

fn flash(ps: &[(String, String)]) -> Option<String> {
    let done = match param(ps, "done")? {
        "retried" => "Retried",
        "discarded" => "Discarded",
        _ => return None,
    };
    match param(ps, "count").and_then(|c| c.parse::<u64>().ok()) {
        Some(n) => {
            let skipped = param(ps, "skipped")
                .and_then(|c| c.parse::<u64>().ok())
                .unwrap_or(0);
            let mut s = format!("{done} {n} message(s).");
            if skipped > 0 {
                s.push_str(&format!(
                    " {skipped} had changed meanwhile (retried, discarded or delivered) and were left alone."
                ));
            }
            Some(s)
        }
        None => Some(format!("{done}.")),
    }
}

fn csrf_refused(st: &State) -> Response {
    error_page(
        st,
        StatusCode::FORBIDDEN,
        "Refused: the form's check failed",
        "The form did not carry a valid CSRF token for this action (it may come from another \
         site, or from before the console restarted). Open the confirmation page again and \
         confirm there.",
    )
}

fn form(body: &Bytes) -> Vec<(String, String)> {
    form_urlencoded::parse(body).into_owned().collect()
}

/// `GET {prefix}/{outbox}/messages?state=&type=&page=`.
pub(crate) async fn list(
    S(st): S<Arc<State>>,
    p: Result<Path<String>, PathRejection>,
    RawQuery(q): RawQuery,
) -> Page {
    let name = path(&st, p)?;
    let o = &st.outbox(&name)?;
    let ps = params(q.as_deref());
    let state: MessageState = param(&ps, "state")
        .unwrap_or("poisoned")
        .parse()
        .map_err(|_| st.bad_request("state must be pending, poisoned or processed."))?;
    let ty = parse_type(&st, param(&ps, "type"))?;
    let size = st.page_size;
    let max_page = MAX_LISTED / size;
    let page_no = page_number(&st, &ps, max_page)?;
    let mut query = ListQuery::new()
        .state(state)
        .limit(size + 1)
        .offset((page_no - 1) * size);
    if let Some(t) = &ty {
        query = query.message_type(t.clone());
    }
    let mut messages = o
        .store
        .list(&query)
        .await
        .map_err(|e| st.store_error("listing messages", &e))?;
    let has_next = messages.len() > size;
    messages.truncate(size);
    if messages.is_empty() && page_no > 1 {
        return Err(error_page(
            &st,
            StatusCode::NOT_FOUND,
            "Past the last page",
            &format!(
                "Page {page_no} is past the last {} message{}; the list has fewer than {} of them.",
                state,
                if ty.is_some() { " of this type" } else { "" },
                (page_no - 1) * size + 1
            ),
        ));
    }
    let now = Timestamp::now();
    let s = state.as_str();
    let title = format!("{}: {s}", o.name);
    let body = html! {
        h1 { (o.name) ": " (s) " messages" @if let Some(t) = &ty { " of type " code { (t) } } }
        @if let Some(f) = flash(&ps) { p.flash { (f) } }
        nav.tabs {
            @for tab in ["poisoned", "pending", "processed"] {
                a class=@if tab == s { "current" } href=(st.list_url(&o.name, tab, ty.as_deref(), 1)) { (tab) }
            }
        }
        form method="get" action={ (st.prefix) "/" (o.name) "/messages" } {
            input type="hidden" name="state" value=(s);
            label { "Type " input type="text" name="type" value=[ty.as_deref()] placeholder="any type"; }
            " " button type="submit" { "Filter" }
            @if ty.is_some() { " " a href=(st.list_url(&o.name, s, None, 1)) { "clear filter" } }
        }
        @if let (Some(t), MessageState::Poisoned, false) = (&ty, state, messages.is_empty()) {
            p.actions {
                "All poisoned " code { (t) } ": "
                a href=(bulk_url(&st, &o.name, "retry", t)) { "retry all…" }
                " · "
                a href=(bulk_url(&st, &o.name, "discard", t)) { "discard all…" }
            }
        } @else if state == MessageState::Poisoned && ty.is_none() && !messages.is_empty() {
            p.note { "Filter by a type (click one) to retry or discard all poisoned messages of it." }
        }
        @if messages.is_empty() {
            p.note { "No " (s) " messages" @if ty.is_some() { " of this type" } "." }
        } @else {
            table {
                thead { tr {
                    th { "id" } th { "type" } th { "key" } th.num { "attempts" } th { "last error" }
                    th { "created" }
                } }
                tbody {
                    @for m in &messages {
                        tr {
                            td { a href=(st.message_url(&o.name, m.id)) { code { (m.id) } } }
                            td { a href=(st.list_url(&o.name, s, Some(&m.message_type), 1)) { (m.message_type) } }
                            td { @if let Some(k) = &m.key { (view::short(k, 40)) } @else { span.note { "—" } } }
                            td.num { (m.attempts) }
                            td { @if let Some(e) = &m.last_error { (view::short(e, 160)) } }
                            td { (view::age(now.since(m.created_at))) " ago" }
                        }
                    }
                }
            }
        }
        p.pager {
            @if page_no > 1 { a href=(st.list_url(&o.name, s, ty.as_deref(), page_no - 1)) { "← previous page" } }
            span.note { "page " (page_no) }
            @if has_next { " " a href=(st.list_url(&o.name, s, ty.as_deref(), page_no + 1)) { "next page →" } }
        }
    };
    Ok(respond(StatusCode::OK, page(&st, &title, body)))
}

fn bulk_url(st: &State, outbox: &str, action: &str, ty: &str) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    q.append_pair("type", ty);
    format!("{}/{outbox}/poisoned/{action}?{}", st.prefix, q.finish())
}

async fn fetch(st: &State, o: &Outbox, id: MessageId) -> Result<Message, Response> {
    match o.store.get(id).await {
        Ok(Some(m)) => Ok(m),
        Ok(None) => Err(error_page(
            st,
            StatusCode::NOT_FOUND,
            "No such message",
            &format!(
                "Outbox \"{}\" has no message {id} (a processed message is gone once retention purges it).",
                o.name
            ),
        )),
        Err(e) => Err(st.store_error("reading the message", &e)),
    }
}

/// `GET {prefix}/{outbox}/messages/{id}`.
pub(crate) async fn detail(
    S(st): S<Arc<State>>,
    p: Result<Path<(String, String)>, PathRejection>,
    RawQuery(q): RawQuery,
) -> Page {
    let (name, id) = path(&st, p)?;
    let o = &st.outbox(&name)?;
    let id = parse_id(&st, &id)?;
    let m = fetch(&st, o, id).await?;
    let ps = params(q.as_deref());
    let now = Timestamp::now();
    let (payload, payload_note) = view::payload(&m.payload);
    let url = st.message_url(&o.name, m.id);
    let body = html! {
        h1 { "Message " code { (m.id) } }
        @if let Some(f) = flash(&ps) { p.flash { (f) } }
        p.actions {
            @if m.state == MessageState::Poisoned { a href={ (url) "/retry" } { "Retry…" } " · " }
            @if m.state != MessageState::Processed { a href={ (url) "/discard" } { "Discard…" } " · " }
            a href=(st.list_url(&o.name, m.state.as_str(), None, 1)) { "all " (m.state) }
        }
        table {
            tbody {
                tr { th { "outbox" } td { (o.name) } }
                tr { th { "state" } td { (m.state) } }
                tr { th { "type" } td { code { (m.message_type) } } }
                tr { th { "kind" } td { (m.kind) } }
                tr { th { "key" } td { @if let Some(k) = &m.key { code { (k) } } @else { span.note { "none" } } } }
                @if let Some(d) = &m.destination {
                    tr { th { "destination" } td { "exchange " code { (d.exchange) } ", routing key " code { (d.routing_key) } } }
                }
                tr { th { "attempts" } td { (m.attempts) } }
                tr { th { "last error" } td { @if let Some(e) = &m.last_error { pre { (e) } } @else { span.note { "none" } } } }
                tr { th { "created" } td { (view::when(m.created_at, now)) } }
                tr { th { "available" } td { (view::when(m.available_at, now)) } }
                @if let Some(t) = m.processed_at { tr { th { "processed" } td { (view::when(t, now)) } } }
                @if let (Some(by), Some(until)) = (&m.locked_by, m.locked_until) {
                    tr { th { "lease" } td { code { (by) } " until " (view::when(until, now)) } }
                }
                tr { th { "trace" } td {
                    @match &m.trace_parent {
                        Some(tp) => {
                            @if let Some(tid) = outbox_api::trace::trace_id_of(tp) {
                                "trace id " code { (tid) } " — "
                                a href=(st.trace_url(tid)) { "every message of this trace" } br;
                            }
                            span.note { "traceparent " code { (tp) } }
                        }
                        None => { span.note { "none recorded" } }
                    }
                } }
            }
        }
        h2 { "Headers" }
        @if m.headers.is_empty() {
            p.note { "none" }
        } @else {
            table { tbody { @for (k, v) in &m.headers { tr { th { code { (k) } } td { code { (v) } } } } } }
        }
        h2 { "Payload" }
        p.note { code { (m.content_type) } ", " (payload_note) }
        pre.payload { (payload) }
    };
    Ok(respond(
        StatusCode::OK,
        page(&st, &format!("Message {}", m.id), body),
    ))
}
