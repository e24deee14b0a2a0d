//! The console over `tower::ServiceExt::oneshot`, on the memory store and a
//! SQLite store: every page, every action with its confirmation step, the
//! CSRF and token refusals, escaping, and bad input.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{StatusCode, header};
use common::*;
use outbox_api::{
    Backlog, ClaimRequest, Error, ErrorKind, FailOutcome, Failure, ListQuery, Message, MessageId,
    MessageState, OperatorStore, Release, Stats, Store, Timestamp,
};
use outbox_console::{Console, ConsoleError, router};

/// Runs `$body` (an async fn taking a `Backend`) once per backend.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Backend::memory().await).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Backend::sqlite().await).await
                }
            )*
        }
    };
}

on_both_backends!(
    overview_counts_and_health,
    lists_filter_and_page,
    detail_shows_headers_payload_and_trace,
    retry_one_after_confirmation,
    discard_one_after_confirmation,
    bulk_actions_touch_only_the_type,
    csrf_refusals_change_nothing,
    payloads_and_fields_are_escaped,
    bad_input_gets_a_clear_4xx_page,
    activity_charts_are_drawn_from_the_rows,
);

/// The activity page draws the last hour from the outbox's rows: its
/// totals, and three SVG charts (no script).
async fn activity_charts_are_drawn_from_the_rows(b: Backend) {
    let delivered = b
        .enqueue(vec![
            domain("OrderPlaced", "{}"),
            domain("OrderPlaced", "{}"),
        ])
        .await;
    let now = Timestamp::now();
    let store = b.store();
    store
        .claim(&outbox_api::ClaimRequest::new(
            "console-test",
            10,
            Duration::from_secs(60),
            now,
        ))
        .await
        .unwrap();
    store.complete(&delivered, now).await.unwrap();
    b.poisoned(vec![domain("OrderPlaced", "{}")], "boom").await;
    b.enqueue(vec![domain("OrderPlaced", "{}")]).await;
    let app = router(console(&b));
    let overview = get(&app, "/").await;
    assert!(
        overview.body.contains(r#"href="/orders/activity""#),
        "the overview links to the activity: {}",
        overview.body
    );
    let page = get(&app, "/orders/activity").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    page.assert_page();
    for want in [
        "2 delivered, 1 failed, 1 poisoned in the hour",
        r#"aria-label="Messages per minute: delivered, failed (last failed try), poisoned""#,
        r#"aria-label="Backlog (pending at the end of each minute): pending""#,
        r#"aria-label="Commit → processed, per minute (upper bound of the class): p50, p99""#,
    ] {
        assert!(
            page.body.contains(want),
            "missing {want:?} in {}",
            page.body
        );
    }
    assert_eq!(page.body.matches("<figure class=\"chart\">").count(), 3);
    assert!(page.body.matches("<polyline").count() >= 4, "{}", page.body);
    assert!(!page.body.contains("<script"), "no scripts");
    let missing = get(&app, "/nowhere/activity").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

fn console(b: &Backend) -> Console {
    Console::new().outbox("orders", b.store()).unwrap()
}

fn state_of(m: &Message) -> (MessageState, u32) {
    (m.state, m.attempts)
}

async fn overview_counts_and_health(b: Backend) {
    b.enqueue(vec![
        domain("OrderPlaced", "{}"),
        domain("OrderPlaced", "{}"),
    ])
    .await;
    let app = router(console(&b));
    let page = get(&app, "/").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    page.assert_page();
    assert!(page.body.contains("orders"), "{}", page.body);
    assert!(
        page.body
            .contains(r#"<span class="status healthy">healthy</span>"#),
        "{}",
        page.body
    );
    assert!(
        page.body.contains(r#"messages?state=pending">2</a>"#),
        "{}",
        page.body
    );
    assert!(
        page.body.contains(r#"messages?state=poisoned">0</a>"#),
        "{}",
        page.body
    );

    b.poisoned(vec![domain("PaymentTaken", "{}")], "card declined")
        .await;
    let page = get(&app, "/").await;
    assert!(
        page.body
            .contains(r#"<span class="status degraded">degraded</span>"#),
        "{}",
        page.body
    );
    assert!(
        page.body
            .contains("1 poisoned message(s) wait for an operator"),
        "{}",
        page.body
    );
    assert!(
        page.body.contains(r#"messages?state=poisoned">1</a>"#),
        "{}",
        page.body
    );

    // The stylesheet is served, as text/css.
    let css = get(&app, "/style.css").await;
    assert_eq!(css.status, StatusCode::OK);
    assert!(
        css.headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/css")
    );
    // Every page forbids scripts and framing.
    let csp = page.headers[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
}

async fn lists_filter_and_page(b: Backend) {
    let poisoned = b
        .poisoned(
            (0..5)
                .map(|i| domain(if i % 2 == 0 { "A" } else { "B" }, "{}").key(format!("k{i}")))
                .collect(),
            "handler said no",
        )
        .await;
    let pending = b.enqueue(vec![domain("C", "{}")]).await;
    let app = router(console(&b).page_size(2));

    let page1 = get(&app, "/orders/messages?state=poisoned").await;
    assert_eq!(page1.status, StatusCode::OK, "{}", page1.body);
    assert!(
        page1.body.contains(&poisoned[0].to_string())
            && page1.body.contains(&poisoned[1].to_string())
    );
    assert!(
        !page1.body.contains(&poisoned[2].to_string()),
        "page size 2"
    );
    assert!(page1.body.contains("handler said no") && page1.body.contains("k0"));
    assert!(
        page1.body.contains("state=poisoned&amp;page=2"),
        "a next link: {}",
        page1.body
    );

    let page3 = get(&app, "/orders/messages?state=poisoned&page=3").await;
    assert!(
        page3.body.contains(&poisoned[4].to_string()),
        "{}",
        page3.body
    );
    assert!(
        !page3.body.contains("page=4"),
        "no next link on the last page"
    );

    let past = get(&app, "/orders/messages?state=poisoned&page=4").await;
    assert_eq!(past.status, StatusCode::NOT_FOUND, "{}", past.body);
    past.assert_page();
    assert!(past.body.contains("past the last"), "{}", past.body);

    let a = get(&app, "/orders/messages?state=poisoned&type=A&page=2").await;
    assert!(
        a.body.contains(&poisoned[4].to_string()),
        "A is 0, 2, 4: {}",
        a.body
    );
    assert!(!a.body.contains(&poisoned[1].to_string()));
    assert!(
        a.body.contains("retry all"),
        "bulk links under a type filter"
    );

    let p = get(&app, "/orders/messages?state=pending").await;
    assert!(p.body.contains(&pending[0].to_string()) && !p.body.contains(&poisoned[0].to_string()));
    // The default list is the poisoned one.
    let d = get(&app, "/orders/messages").await;
    assert!(d.body.contains(&poisoned[0].to_string()), "{}", d.body);
    let none = get(&app, "/orders/messages?state=processed").await;
    assert_eq!(none.status, StatusCode::OK);
    assert!(none.body.contains("No processed messages"), "{}", none.body);
}

async fn detail_shows_headers_payload_and_trace(b: Backend) {
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let ids = b
        .poisoned(
            vec![
                domain("OrderPlaced", r#"{"order_id":42,"lines":[1,2]}"#)
                    .key("order-42")
                    .header("tenant", "acme")
                    .trace_parent(tp),
            ],
            "stock service said 503",
        )
        .await;
    let app = router(console(&b));
    let page = get(&app, &format!("/orders/messages/{}", ids[0])).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    page.assert_page();
    for want in [
        "OrderPlaced",
        "order-42",
        "tenant",
        "acme",
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "stock service said 503",
        "poisoned",
        "JSON (pretty-printed)",
        // Pretty: one field per line, indented.
        "{\n  &quot;order_id&quot;: 42,",
    ] {
        assert!(
            page.body.contains(want),
            "missing {want:?} in {}",
            page.body
        );
    }
    assert!(page.body.contains("/retry\">Retry…") && page.body.contains("/discard\">Discard…"));
}

async fn retry_one_after_confirmation(b: Backend) {
    let ids = b.poisoned(vec![domain("OrderPlaced", "{}")], "boom").await;
    let id = ids[0];
    let app = router(console(&b));
    let url = format!("/orders/messages/{id}/retry");

    // The confirmation step: a page with a form, nothing changed yet.
    let confirm = get(&app, &url).await;
    assert_eq!(confirm.status, StatusCode::OK, "{}", confirm.body);
    assert!(confirm.body.contains(r#"method="post""#) && confirm.body.contains("Yes, retry it"));
    let m = b.store().get(id).await.unwrap().unwrap();
    assert_eq!(
        state_of(&m),
        (MessageState::Poisoned, 1),
        "GET changes nothing"
    );

    let done = post(&app, &url, &[("csrf", &confirm.csrf())]).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    assert_eq!(
        done.location(),
        format!("/orders/messages/{id}?done=retried")
    );
    let m = b.store().get(id).await.unwrap().unwrap();
    assert_eq!(state_of(&m), (MessageState::Pending, 0));
    let note = m.last_error.unwrap();
    assert!(
        note.contains("retried by outbox-console (127.0.0.1)") && note.contains("boom"),
        "{note}"
    );

    let after = get(&app, done.location()).await;
    assert!(after.body.contains("Retried."), "{}", after.body);
    // Retrying again is a conflict, on the confirmation page and the POST.
    let again = get(&app, &url).await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);
    again.assert_page();
    let again = post(&app, &url, &[("csrf", &confirm.csrf())]).await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);
    assert!(again.body.contains("not poisoned"), "{}", again.body);
}

async fn discard_one_after_confirmation(b: Backend) {
    let pending = b.enqueue(vec![domain("OrderPlaced", "{}")]).await[0];
    let app = router(console(&b));
    let url = format!("/orders/messages/{pending}/discard");
    let confirm = get(&app, &url).await;
    assert_eq!(confirm.status, StatusCode::OK, "{}", confirm.body);
    assert!(confirm.body.contains("never sent"), "{}", confirm.body);
    let done = post(&app, &url, &[("csrf", &confirm.csrf())]).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    let m = b.store().get(pending).await.unwrap().unwrap();
    assert_eq!(m.state, MessageState::Processed);
    assert!(
        m.last_error
            .unwrap()
            .contains("discarded by outbox-console")
    );
    // A processed message has nothing to discard.
    let again = get(&app, &url).await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);
}

async fn bulk_actions_touch_only_the_type(b: Backend) {
    let a = b
        .poisoned(
            vec![domain("A", "{}"), domain("A", "{}"), domain("A", "{}")],
            "no",
        )
        .await;
    let other = b.poisoned(vec![domain("B", "{}")], "no").await;
    let app = router(console(&b));

    let confirm = get(&app, "/orders/poisoned/retry?type=A").await;
    assert_eq!(confirm.status, StatusCode::OK, "{}", confirm.body);
    assert!(
        confirm.body.contains("retry all 3 poisoned"),
        "{}",
        confirm.body
    );
    let done = post(
        &app,
        "/orders/poisoned/retry",
        &[("type", "A"), ("csrf", &confirm.csrf())],
    )
    .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    let store = b.store();
    for id in &a {
        let m = store.get(*id).await.unwrap().unwrap();
        assert_eq!(state_of(&m), (MessageState::Pending, 0), "{id}");
    }
    assert_eq!(
        store.get(other[0]).await.unwrap().unwrap().state,
        MessageState::Poisoned,
        "type B untouched"
    );
    let list = get(&app, done.location()).await;
    assert!(list.body.contains("Retried 3 message(s)."), "{}", list.body);

    // A CSRF token for type A does not discard type B.
    let a_token = get(&app, "/orders/poisoned/discard?type=A").await;
    assert!(
        a_token.body.contains("No poisoned"),
        "none left: {}",
        a_token.body
    );
    let confirm_b = get(&app, "/orders/poisoned/discard?type=B").await;
    let wrong = post(
        &app,
        "/orders/poisoned/discard",
        &[("type", "B"), ("csrf", &confirm.csrf())],
    )
    .await;
    assert_eq!(wrong.status, StatusCode::FORBIDDEN, "{}", wrong.body);
    let done = post(
        &app,
        "/orders/poisoned/discard",
        &[("type", "B"), ("csrf", &confirm_b.csrf())],
    )
    .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    assert_eq!(
        store.get(other[0]).await.unwrap().unwrap().state,
        MessageState::Processed
    );
}

async fn csrf_refusals_change_nothing(b: Backend) {
    let ids = b
        .poisoned(vec![domain("A", "{}"), domain("A", "{}")], "no")
        .await;
    let app = router(console(&b));
    let url0 = format!("/orders/messages/{}/retry", ids[0]);
    let url1 = format!("/orders/messages/{}/retry", ids[1]);
    let token0 = get(&app, &url0).await.csrf();
    let discard0 = get(&app, &format!("/orders/messages/{}/discard", ids[0]))
        .await
        .csrf();

    let refusals = [
        ("no token", post(&app, &url0, &[]).await),
        (
            "a wrong token",
            post(&app, &url0, &[("csrf", "00ff")]).await,
        ),
        (
            "another message's token",
            post(&app, &url1, &[("csrf", &token0)]).await,
        ),
        (
            "another action's token",
            post(&app, &url0, &[("csrf", &discard0)]).await,
        ),
        (
            "another process's token",
            post(&router(console(&b)), &url0, &[("csrf", &token0)]).await,
        ),
    ];
    for (what, r) in refusals {
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{what}: {}", r.body);
        r.assert_page();
        assert!(r.body.contains("CSRF"), "{what}: {}", r.body);
    }
    // A cross-site form carrying a valid token is refused on its origin.
    for (name, value) in [
        ("origin", "http://evil.example"),
        ("origin", "null"),
        ("sec-fetch-site", "cross-site"),
    ] {
        let r = send(
            &app,
            request("POST", &url0)
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .header(name, value)
                .body(Body::from(form_body(&[("csrf", &token0)])))
                .unwrap(),
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::FORBIDDEN,
            "{name}: {value}: {}",
            r.body
        );
        assert!(r.body.contains("cross-site"), "{}", r.body);
    }
    // A GET never acts.
    let r = get(&app, &format!("{url0}?csrf={token0}")).await;
    assert_eq!(r.status, StatusCode::OK);
    for id in &ids {
        let m = b.store().get(*id).await.unwrap().unwrap();
        assert_eq!(m.state, MessageState::Poisoned, "nothing was retried");
    }
    // And the right token still works.
    let ok = post(&app, &url0, &[("csrf", &token0)]).await;
    assert_eq!(ok.status, StatusCode::SEE_OTHER, "{}", ok.body);
}

const SCRIPT: &str = "<script>document.title='pwned'</script>";

async fn payloads_and_fields_are_escaped(b: Backend) {
    let ids = b
        .poisoned(
            vec![
                domain("Evil<b>Type</b>", SCRIPT)
                    .content_type("text/html")
                    .key("<img src=x onerror=alert(1)>")
                    .header("x\"><script>", "\"><script>alert(2)</script>"),
            ],
            "<script>alert('error')</script>",
        )
        .await;
    let app = router(console(&b));
    let pages = [
        get(&app, &format!("/orders/messages/{}", ids[0])).await,
        get(&app, "/orders/messages?state=poisoned").await,
        get(&app, &format!("/orders/messages/{}/retry", ids[0])).await,
        get(
            &app,
            "/orders/poisoned/retry?type=Evil%3Cb%3EType%3C%2Fb%3E",
        )
        .await,
        get(&app, "/orders/messages?state=poisoned&type=%3Cscript%3Ex").await,
    ];
    for p in pages {
        assert_eq!(p.status, StatusCode::OK, "{}", p.body);
        for raw in ["<script", "<img", "<b>"] {
            assert!(!p.body.contains(raw), "{raw} unescaped in {}", p.body);
        }
        assert!(p.body.contains("&lt;"), "escaped text is shown: {}", p.body);
    }
    let detail = get(&app, &format!("/orders/messages/{}", ids[0])).await;
    assert!(
        detail
            .body
            .contains("&lt;script&gt;document.title='pwned'&lt;/script&gt;"),
        "the payload shows as text: {}",
        detail.body
    );
}

async fn bad_input_gets_a_clear_4xx_page(b: Backend) {
    let poisoned = b.poisoned(vec![domain("A", "{}")], "no").await[0];
    let pending = b.enqueue(vec![domain("A", "{}")]).await[0];
    let app = router(console(&b));
    let unknown = MessageId::new();
    let cases: Vec<(String, StatusCode, &str)> = vec![
        (
            "/nope/messages".into(),
            StatusCode::NOT_FOUND,
            "No such outbox",
        ),
        (
            "/%3Cscript%3E/messages".into(),
            StatusCode::NOT_FOUND,
            "No such outbox",
        ),
        (
            "/orders/messages/not-a-uuid".into(),
            StatusCode::BAD_REQUEST,
            "is not a message id",
        ),
        (
            format!("/orders/messages/{unknown}"),
            StatusCode::NOT_FOUND,
            "has no message",
        ),
        (
            format!("/orders/messages/{unknown}/retry"),
            StatusCode::NOT_FOUND,
            "has no message",
        ),
        (
            format!("/orders/messages/{poisoned}/explode"),
            StatusCode::NOT_FOUND,
            "retry and discard",
        ),
        (
            format!("/orders/messages/{pending}/retry"),
            StatusCode::CONFLICT,
            "not poisoned",
        ),
        (
            "/orders/messages?page=99999999999999999999999999".into(),
            StatusCode::BAD_REQUEST,
            "page must be",
        ),
        (
            "/orders/messages?page=20001".into(),
            StatusCode::BAD_REQUEST,
            "page must be",
        ),
        (
            "/orders/messages?page=0".into(),
            StatusCode::BAD_REQUEST,
            "page must be",
        ),
        (
            "/orders/messages?page=-1".into(),
            StatusCode::BAD_REQUEST,
            "page must be",
        ),
        (
            "/orders/messages?page=abc".into(),
            StatusCode::BAD_REQUEST,
            "page must be",
        ),
        (
            "/orders/messages?state=lost".into(),
            StatusCode::BAD_REQUEST,
            "state must be",
        ),
        (
            format!("/orders/messages?type={}", "x".repeat(300)),
            StatusCode::BAD_REQUEST,
            "at most 255",
        ),
        (
            "/orders/poisoned/retry".into(),
            StatusCode::BAD_REQUEST,
            "Say which message type",
        ),
        (
            "/orders/poisoned/explode?type=A".into(),
            StatusCode::NOT_FOUND,
            "retry and discard",
        ),
        (
            "/orders/messages?state=poisoned&page=2".into(),
            StatusCode::NOT_FOUND,
            "past the last",
        ),
    ];
    for (uri, status, says) in cases {
        let r = get(&app, &uri).await;
        assert_eq!(r.status, status, "{uri}: {}", r.body);
        r.assert_page();
        assert!(
            r.body.contains(says),
            "{uri}: wanted {says:?} in {}",
            r.body
        );
    }
    // POSTs with bad input: refused before the CSRF check can matter.
    let r = post(&app, "/orders/messages/not-a-uuid/retry", &[("csrf", "x")]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    let r = post(&app, "/nope/poisoned/retry", &[("type", "A")]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.body);
    let r = post(&app, "/orders/poisoned/retry", &[]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    // A POST to a page that only shows is not allowed.
    let r = post(&app, "/orders/messages", &[]).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{}", r.body);
}

// ---- security: token and loopback (one backend is enough: it is the router) ----

const TOKEN: &str = "correct-horse-battery-staple-42";

async fn with_token() -> (axum::Router, Backend) {
    let b = Backend::memory().await;
    b.poisoned(vec![domain("A", "{}")], "no").await;
    let app = router(console(&b).token(TOKEN).unwrap());
    (app, b)
}

#[tokio::test]
async fn token_is_required_on_every_page() {
    let (app, b) = with_token().await;
    let id = b.store().list(&ListQuery::new()).await.unwrap()[0].id;
    for uri in [
        "/".to_owned(),
        "/orders/messages".to_owned(),
        format!("/orders/messages/{id}"),
        format!("/orders/messages/{id}/retry"),
        "/orders/poisoned/retry?type=A".to_owned(),
        "/nope/messages".to_owned(),
    ] {
        let r = get(&app, &uri).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{uri}: {}", r.body);
        r.assert_page();
        assert!(
            r.body.contains(r#"name="token""#),
            "a login form: {}",
            r.body
        );
        assert!(
            !r.body.contains("orders"),
            "no outbox name before login: {}",
            r.body
        );
        assert!(r.headers.contains_key(header::WWW_AUTHENTICATE));
    }
    // A POST without the token does nothing, whatever it carries.
    let r = post(
        &app,
        &format!("/orders/messages/{id}/retry"),
        &[("csrf", "x")],
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        b.store().get(id).await.unwrap().unwrap().state,
        MessageState::Poisoned
    );
    // The login page and the stylesheet are open.
    assert_eq!(get(&app, "/login").await.status, StatusCode::OK);
    assert_eq!(get(&app, "/style.css").await.status, StatusCode::OK);
}

#[tokio::test]
async fn bearer_token_and_login_cookie() {
    let (app, _b) = with_token().await;
    let bearer = |t: &str| {
        request("GET", "/")
            .header(header::AUTHORIZATION, format!("Bearer {t}"))
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(
        send(&app, bearer("wrong-token-wrong-token")).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        send(&app, bearer(&TOKEN[..TOKEN.len() - 1])).await.status,
        StatusCode::UNAUTHORIZED
    );
    let ok = send(&app, bearer(TOKEN)).await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
    assert!(!ok.body.contains(TOKEN), "the token is never in a page");

    let wrong = post(&app, "/login", &[("token", "not-the-token-at-all")]).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{}", wrong.body);
    assert!(wrong.body.contains("not the console's token"));
    assert!(!wrong.headers.contains_key(header::SET_COOKIE));

    let login = post(&app, "/login", &[("token", TOKEN)]).await;
    assert_eq!(login.status, StatusCode::SEE_OTHER, "{}", login.body);
    let set_cookie = login.headers[header::SET_COOKIE]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        set_cookie.contains("HttpOnly") && set_cookie.contains("SameSite=Strict"),
        "{set_cookie}"
    );
    assert!(
        !set_cookie.contains(TOKEN),
        "the cookie is not the token: {set_cookie}"
    );
    let cookie = set_cookie.split(';').next().unwrap().to_owned();

    let with_cookie = |c: &str| {
        request("GET", "/orders/messages")
            .header(header::COOKIE, format!("theme=dark; {c}"))
            .body(Body::empty())
            .unwrap()
    };
    let r = send(&app, with_cookie(&cookie)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(!r.body.contains(TOKEN));
    // The last character changed (to one it is not: a random cookie ends
    // in `0` now and then).
    let last = if cookie.ends_with('0') { '1' } else { '0' };
    let forged = format!("{}{last}", &cookie[..cookie.len() - 1]);
    assert_ne!(forged, cookie);
    assert_eq!(
        send(&app, with_cookie(&forged)).await.status,
        StatusCode::UNAUTHORIZED
    );
    // A cookie from another process (restarted console) is not valid.
    let other = router(Console::new().token(TOKEN).unwrap());
    assert_eq!(
        send(&other, with_cookie(&cookie)).await.status,
        StatusCode::UNAUTHORIZED
    );

    // Logout needs its CSRF token and clears the cookie.
    let csrf = r.csrf();
    let out = send(
        &app,
        request("POST", "/logout")
            .header(header::COOKIE, &cookie)
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(Body::from(form_body(&[("csrf", &csrf)])))
            .unwrap(),
    )
    .await;
    assert_eq!(out.status, StatusCode::SEE_OTHER, "{}", out.body);
    assert!(
        out.headers[header::SET_COOKIE]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
}

#[tokio::test]
async fn with_a_token_any_peer_may_use_it() {
    let (app, _b) = with_token().await;
    let r = send(
        &app,
        axum::http::Request::builder()
            .uri("/")
            .header(header::HOST, "console.example.com")
            .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
            .extension(axum::extract::ConnectInfo(std::net::SocketAddr::from((
                [192, 0, 2, 7],
                4000,
            ))))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

#[tokio::test]
async fn without_a_token_only_loopback_is_served() {
    let b = Backend::memory().await;
    let app = router(console(&b));
    let req = |peer: Option<[u8; 4]>, host: &str| {
        let mut r = axum::http::Request::builder()
            .uri("/")
            .header(header::HOST, host);
        if let Some(ip) = peer {
            r = r.extension(axum::extract::ConnectInfo(std::net::SocketAddr::from((
                ip, 4000,
            ))));
        }
        r.body(Body::empty()).unwrap()
    };
    let remote = send(&app, req(Some([192, 0, 2, 7]), "127.0.0.1")).await;
    assert_eq!(remote.status, StatusCode::FORBIDDEN, "{}", remote.body);
    assert!(remote.body.contains("loopback"));
    let unknown_peer = send(&app, req(None, "127.0.0.1")).await;
    assert_eq!(
        unknown_peer.status,
        StatusCode::FORBIDDEN,
        "{}",
        unknown_peer.body
    );
    assert!(
        unknown_peer
            .body
            .contains("into_make_service_with_connect_info")
    );
    let rebinding = send(&app, req(Some([127, 0, 0, 1]), "evil.example:8080")).await;
    assert_eq!(
        rebinding.status,
        StatusCode::FORBIDDEN,
        "{}",
        rebinding.body
    );
    for host in ["localhost:8080", "127.0.0.1", "[::1]:9000"] {
        let ok = send(&app, req(Some([127, 0, 0, 1]), host)).await;
        assert_eq!(ok.status, StatusCode::OK, "{host}: {}", ok.body);
    }
}

#[tokio::test]
async fn mounted_under_a_prefix_beside_app_routes() {
    let b = Backend::sqlite().await;
    let ids = b.poisoned(vec![domain("A", "{}")], "no").await;
    let console = console(&b).path_prefix("/outbox/").unwrap();
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "app ok" }))
        .merge(router(console));
    let health = get(&app, "/health").await;
    assert_eq!(
        (health.status, health.body.as_str()),
        (StatusCode::OK, "app ok")
    );
    let slash = get(&app, "/outbox/").await;
    assert_eq!(slash.status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(slash.location(), "/outbox");
    for uri in ["/outbox"] {
        let r = get(&app, uri).await;
        assert_eq!(r.status, StatusCode::OK, "{uri}: {}", r.body);
        assert!(r.body.contains(r#"href="/outbox/style.css""#), "{}", r.body);
        assert!(
            r.body
                .contains(r#"href="/outbox/orders/messages?state=poisoned""#),
            "{}",
            r.body
        );
    }
    let confirm = get(&app, &format!("/outbox/orders/messages/{}/retry", ids[0])).await;
    assert!(confirm.body.contains(&format!(
        r#"action="/outbox/orders/messages/{}/retry""#,
        ids[0]
    )));
    let done = post(
        &app,
        &format!("/outbox/orders/messages/{}/retry", ids[0]),
        &[("csrf", &confirm.csrf())],
    )
    .await;
    assert_eq!(
        done.location(),
        format!("/outbox/orders/messages/{}?done=retried", ids[0])
    );
    let missing = get(&app, "/outbox/orders/nothing/here").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    missing.assert_page();
    // Outside the prefix, the console answers nothing.
    assert_eq!(
        get(&app, "/orders/messages").await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn several_outboxes_side_by_side() {
    let (a, b) = (Backend::memory().await, Backend::sqlite().await);
    a.poisoned(vec![domain("A", "{}")], "no").await;
    let in_b = b.enqueue(vec![domain("B", "{}")]).await[0];
    let app = router(
        Console::new()
            .outbox("orders", a.store())
            .unwrap()
            .outbox("billing", b.store())
            .unwrap(),
    );
    let page = get(&app, "/").await;
    assert!(
        page.body.contains("orders") && page.body.contains("billing"),
        "{}",
        page.body
    );
    assert_eq!(
        get(&app, &format!("/billing/messages/{in_b}")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get(&app, &format!("/orders/messages/{in_b}")).await.status,
        StatusCode::NOT_FOUND,
        "ids are looked up in their own outbox"
    );
}

/// The console's list of outboxes changes while it serves (a tenant
/// created or deleted): the next page shows it, and a removed outbox's
/// pages answer 404; the list's own rules hold for an outbox added late.
#[tokio::test]
async fn outboxes_added_and_removed_while_serving_show_on_the_next_page() {
    let (a, b) = (Backend::memory().await, Backend::sqlite().await);
    let in_b = b.enqueue(vec![domain("B", "{}")]).await[0];
    let console = Console::new().outbox("orders", a.store()).unwrap();
    let list = console.outbox_list();
    let app = router(console);
    let page = get(&app, "/").await;
    assert!(!page.body.contains("billing"), "{}", page.body);
    assert_eq!(
        get(&app, &format!("/billing/messages/{in_b}")).await.status,
        StatusCode::NOT_FOUND
    );

    list.add("billing", b.store()).unwrap();
    assert_eq!(list.names(), ["orders", "billing"]);
    let page = get(&app, "/").await;
    assert!(page.body.contains("billing"), "{}", page.body);
    assert!(page.body.contains("2 outboxes"), "{}", page.body);
    assert_eq!(
        get(&app, &format!("/billing/messages/{in_b}")).await.status,
        StatusCode::OK
    );
    let e = list.add("billing", b.store()).unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
    assert!(matches!(
        list.add("login", b.store()),
        Err(ConsoleError::Config(_))
    ));

    assert!(list.remove("orders"));
    assert!(!list.remove("orders"), "removed once");
    let page = get(&app, "/").await;
    assert!(page.body.contains("1 outbox: "), "{}", page.body);
    let gone = get(&app, "/orders/messages?state=pending").await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    assert!(
        gone.body.contains("billing"),
        "names what it shows: {}",
        gone.body
    );
    assert!(list.remove("billing"));
    let page = get(&app, "/").await;
    assert!(page.body.contains("shows no outbox"), "{}", page.body);
}

/// The saga view: from a message's trace id, every message of that trace
/// in every outbox (memory and SQLite side by side), in commit order, with
/// state and attempts; nothing of another trace; a bad id is a 400.
#[tokio::test]
async fn a_trace_shows_its_messages_across_the_outboxes() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let tp = |span: &str| format!("00-{TRACE}-{span}-01");
    let (ordering, warehouse) = (Backend::memory().await, Backend::sqlite().await);
    let placed = ordering
        .enqueue(vec![
            domain("OrderPlaced", "{}").trace_parent(tp("00f067aa0ba902b7")),
        ])
        .await[0];
    let answer = warehouse
        .poisoned(
            vec![domain("StockReserved", "{}").trace_parent(tp("b7ad6b7169203331"))],
            "billing said 503",
        )
        .await[0];
    let other = ordering
        .enqueue(vec![domain("Unrelated", "{}").trace_parent(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )])
        .await[0];
    let app = router(
        Console::new()
            .outbox("ordering", ordering.store())
            .unwrap()
            .outbox("warehouse", warehouse.store())
            .unwrap(),
    );
    // The message's page links to its trace.
    let detail = get(&app, &format!("/ordering/messages/{placed}")).await;
    assert!(
        detail.body.contains(&format!("href=\"/traces/{TRACE}\"")),
        "{}",
        detail.body
    );

    let page = get(&app, &format!("/traces/{TRACE}")).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    page.assert_page();
    let at = |needle: &str| {
        page.body
            .find(needle)
            .unwrap_or_else(|| panic!("missing {needle:?} in {}", page.body))
    };
    assert!(
        at(&placed.to_string()) < at(&answer.to_string()),
        "commit order: the order before its answer"
    );
    for want in [
        "OrderPlaced",
        "StockReserved",
        "poisoned",
        "pending",
        "billing said 503",
        ">warehouse<",
    ] {
        at(want);
    }
    assert!(!page.body.contains(&other.to_string()) && !page.body.contains("Unrelated"));

    let none = get(&app, "/traces/1af7651916cd43dd8448eb211c80319c").await;
    assert_eq!(none.status, StatusCode::OK);
    assert!(
        none.body.contains("No message carries this trace."),
        "{}",
        none.body
    );
    let bad = get(&app, "/traces/not-a-trace").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.body);
    assert!(bad.body.contains("32 lowercase hex digits"), "{}", bad.body);
}

#[tokio::test]
async fn a_relay_health_report_is_shown_when_given() {
    let b = Backend::memory().await;
    let app = router(
        Console::new()
            .outbox_with_health("orders", b.store(), || async {
                outbox_api::HealthReport::new(outbox_api::HealthStatus::Unhealthy, false)
                    .with_reasons(vec!["the relay has stopped".into()])
            })
            .unwrap(),
    );
    let page = get(&app, "/").await;
    assert!(
        page.body
            .contains(r#"<span class="status unhealthy">unhealthy</span>"#),
        "{}",
        page.body
    );
    assert!(page.body.contains("the relay has stopped"));
    assert!(!page.body.contains("(from the table)"));
}

/// A store whose every call fails as an unreachable database does.
#[derive(Debug)]
struct Down;

fn down() -> Error {
    Error::new(ErrorKind::Unavailable, "database is unreachable")
}

#[async_trait]
impl Store for Down {
    async fn claim(&self, _: &ClaimRequest) -> outbox_api::Result<Vec<Message>> {
        Err(down())
    }
    async fn complete(&self, _: &[MessageId], _: Timestamp) -> outbox_api::Result<()> {
        Err(down())
    }
    async fn fail(&self, _: &Failure) -> outbox_api::Result<FailOutcome> {
        Err(down())
    }
    async fn release(&self, _: &Release) -> outbox_api::Result<()> {
        Err(down())
    }
    async fn release_worker(&self, _: &str) -> outbox_api::Result<u64> {
        Err(down())
    }
    async fn stats(&self) -> outbox_api::Result<Stats> {
        Err(down())
    }
    async fn backlog(&self) -> outbox_api::Result<Backlog> {
        Err(down())
    }
    async fn purge_processed(&self, _: Timestamp, _: usize) -> outbox_api::Result<u64> {
        Err(down())
    }
}

#[async_trait]
impl OperatorStore for Down {
    async fn list(&self, _: &ListQuery) -> outbox_api::Result<Vec<Message>> {
        Err(down())
    }
    async fn get(&self, _: MessageId) -> outbox_api::Result<Option<Message>> {
        Err(down())
    }
    async fn retry(&self, _: MessageId, _: &str, _: Timestamp) -> outbox_api::Result<()> {
        Err(down())
    }
    async fn discard(&self, _: MessageId, _: &str, _: Timestamp) -> outbox_api::Result<()> {
        Err(down())
    }
    async fn activity_counts(
        &self,
        _: &outbox_api::activity::ActivityWindow,
    ) -> outbox_api::Result<outbox_api::activity::ActivityCounts> {
        Err(down())
    }
}

#[tokio::test]
async fn a_store_that_is_down_gets_a_page_not_a_500() {
    let ok = Backend::memory().await;
    let app = router(
        Console::new()
            .outbox("down", Arc::new(Down))
            .unwrap()
            .outbox("up", ok.store())
            .unwrap(),
    );
    let overview = get(&app, "/").await;
    assert_eq!(
        overview.status,
        StatusCode::OK,
        "one outbox down does not hide the others"
    );
    assert!(
        overview.body.contains("unavailable") && overview.body.contains("database is unreachable")
    );
    assert!(
        overview.body.contains(r#"class="status healthy""#),
        "{}",
        overview.body
    );
    let id = MessageId::new();
    for uri in [
        "/down/messages".to_owned(),
        format!("/down/messages/{id}"),
        "/down/activity".to_owned(),
    ] {
        let r = get(&app, &uri).await;
        assert_eq!(
            r.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{uri}: {}",
            r.body
        );
        r.assert_page();
        assert!(r.body.contains("database is unreachable"));
    }
}

#[tokio::test]
async fn settings_are_checked() {
    let store: Arc<dyn OperatorStore> = Arc::new(Down);
    for bad in [
        "",
        "has space",
        "a/b",
        "login",
        "x".repeat(65).as_str(),
        "<b>",
    ] {
        let e = Console::new().outbox(bad, store.clone()).unwrap_err();
        assert!(matches!(e, ConsoleError::Config(_)), "{bad:?}: {e}");
    }
    let e = Console::new()
        .outbox("a", store.clone())
        .unwrap()
        .outbox("a", store.clone())
        .unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
    let e = Console::new().token("short").unwrap_err();
    assert!(e.to_string().contains("too short"), "{e}");
    for bad in ["outbox", "/a b", "/a/../b", "//x", "/<x>"] {
        assert!(Console::new().path_prefix(bad).is_err(), "{bad:?}");
    }
    for good in ["", "/", "/outbox", "/ops/outbox/"] {
        assert!(Console::new().path_prefix(good).is_ok(), "{good:?}");
    }
    let c = Console::new().token(TOKEN).unwrap();
    assert!(c.has_token());
    let debug = format!("{c:?}");
    assert!(
        !debug.contains(TOKEN) && debug.contains("redacted"),
        "{debug}"
    );
}

#[tokio::test]
async fn serve_refuses_a_public_address_without_a_token() {
    let e = outbox_console::serve("0.0.0.0:0".parse().unwrap(), Console::new())
        .await
        .unwrap_err();
    assert!(matches!(e, ConsoleError::NeedsToken(_)), "{e}");
    assert!(e.to_string().contains("OUTBOX_CONSOLE_TOKEN"), "{e}");
}

#[tokio::test]
async fn serve_on_answers_over_tcp_with_the_peer_known() {
    use http_body_util::BodyExt;
    let b = Backend::memory().await;
    let ids = b.poisoned(vec![domain("A", "{}")], "no").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(outbox_console::serve_on(listener, console(&b), async {
        let _ = stopped.await;
    }));
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<String>();
    let fetch = |path: String| {
        let client = client.clone();
        async move {
            let res = client
                .get(format!("http://{addr}{path}").parse().unwrap())
                .await
                .unwrap();
            let status = res.status();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(body.to_vec()).unwrap())
        }
    };
    let (status, body) = fetch("/".into()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("orders"));
    let (status, body) = fetch(format!("/orders/messages/{}", ids[0])).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = fetch("/no/such/page/at/all".into()).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(body.contains("Not found"));
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("the server stops on its shutdown signal")
        .unwrap()
        .unwrap();
}

/// The outbox names of an overview's rows, in order.
fn overview_rows(body: &str) -> Vec<String> {
    body.split("<tr><td>")
        .skip(1)
        .map(|row| match row.strip_prefix("<a href=\"/") {
            Some(linked) => linked.split('/').next().unwrap().to_owned(),
            None => row.split("</td>").next().unwrap().to_owned(),
        })
        .collect()
}

/// The line on top of the overview.
fn summary(body: &str) -> &str {
    let start = body
        .find(r#"<p class="summary">"#)
        .unwrap_or_else(|| panic!("no summary in {body}"));
    let end = body[start..].find("</p>").unwrap() + start;
    &body[start..end]
}

fn names(range: impl IntoIterator<Item = usize>) -> Vec<String> {
    range
        .into_iter()
        .map(|i| format!("tenant_{i:02}"))
        .collect()
}

/// A fleet's overview: 25 tenants (two with a poisoned message) and an
/// outbox whose store is down, ten a page. The line on top counts all of
/// them by status and names the three that are not healthy; `q` filters
/// by a part of the name, `status` by health, and the pages follow the
/// filter.
#[tokio::test]
async fn overview_filters_by_name_and_status_and_pages() {
    let mut console = Console::new().page_size(10);
    let mut backends = Vec::new();
    for i in 0..25 {
        let b = Backend::memory().await;
        if i == 7 || i == 19 {
            b.poisoned(vec![domain("A", "{}")], "no").await;
        } else {
            b.enqueue(vec![domain("A", "{}")]).await;
        }
        console = console.outbox(format!("tenant_{i:02}"), b.store()).unwrap();
        backends.push(b);
    }
    let app = router(console.outbox("billing", Arc::new(Down)).unwrap());

    let page = get(&app, "/").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    page.assert_page();
    assert_eq!(overview_rows(&page.body), names(0..10));
    let top = summary(&page.body);
    assert!(top.contains("26 outboxes: "), "{top}");
    for want in [
        r#"23 <span class="status healthy">healthy</span>"#,
        r#"2 <span class="status degraded">degraded</span>"#,
        r#"1 <span class="status unavailable">unavailable</span>"#,
        ">tenant_07</a>",
        ">tenant_19</a>",
        ">billing</a>",
    ] {
        assert!(top.contains(want), "missing {want:?} in {top}");
    }
    assert!(
        !top.contains("tenant_00"),
        "only the unhealthy are named: {top}"
    );
    assert!(page.body.contains("page 1 of 3"), "{}", page.body);
    assert!(page.body.contains(r#"href="/?page=2""#), "{}", page.body);
    // The navigation links to the overview, not to 26 outboxes.
    let header = &page.body[..page.body.find("</header>").unwrap()];
    assert!(
        header.contains("26 outboxes") && !header.contains("tenant_"),
        "{header}"
    );

    let last = get(&app, "/?page=3").await;
    let mut want = names(20..25);
    want.push("billing".to_owned());
    assert_eq!(overview_rows(&last.body), want);
    assert!(
        last.body.contains("database is unreachable"),
        "{}",
        last.body
    );
    assert!(!last.body.contains("next page"), "{}", last.body);
    assert_eq!(get(&app, "/?page=4").await.status, StatusCode::NOT_FOUND);
    for bad in ["/?page=0", "/?page=x", "/?status=sick"] {
        let r = get(&app, bad).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {}", r.body);
        r.assert_page();
    }

    // By a part of the name, in any case: tenant_10 … tenant_19, one page.
    let page = get(&app, "/?q=TENANT_1").await;
    assert_eq!(overview_rows(&page.body), names(10..20));
    assert!(
        page.body
            .contains("Outboxes 1–10 of 10 matching the filter."),
        "{}",
        page.body
    );
    assert!(page.body.contains(r#"value="TENANT_1""#), "{}", page.body);
    assert_eq!(
        get(&app, "/?q=tenant_1&page=2").await.status,
        StatusCode::NOT_FOUND
    );

    // By status.
    let page = get(&app, "/?status=not-healthy").await;
    assert_eq!(
        overview_rows(&page.body),
        ["tenant_07", "tenant_19", "billing"]
    );
    assert!(
        page.body
            .contains(r#"<option value="not-healthy" selected>"#),
        "{}",
        page.body
    );
    let page = get(&app, "/?status=not-healthy&q=tenant").await;
    assert_eq!(overview_rows(&page.body), ["tenant_07", "tenant_19"]);
    let page = get(&app, "/?status=degraded").await;
    assert_eq!(overview_rows(&page.body), ["tenant_07", "tenant_19"]);
    // The pages of a filter keep it.
    let page = get(&app, "/?status=healthy&page=2").await;
    assert!(
        page.body.contains(r#"href="/?status=healthy&amp;page=3""#),
        "{}",
        page.body
    );
    let page = get(&app, "/?status=healthy&page=3").await;
    assert_eq!(
        overview_rows(&page.body),
        ["tenant_22", "tenant_23", "tenant_24"]
    );

    // What is typed into the filter is shown escaped.
    let page = get(&app, "/?q=%3Cscript%3Ealert(1)%3C%2Fscript%3E").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(page.body.contains("No outbox matches the filter."));
    assert!(!page.body.contains("<script>"), "{}", page.body);
    assert!(page.body.contains("&lt;script&gt;"), "{}", page.body);
    let long = get(&app, &format!("/?q={}", "a".repeat(65))).await;
    assert_eq!(long.status, StatusCode::BAD_REQUEST);
}

/// A store that counts how many of its reads run at the same time (each
/// read yields to the scheduler a few times while it counts).
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn OperatorStore>,
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl Counting {
    async fn counted<T>(&self, read: impl std::future::Future<Output = T>) -> T {
        let at_once = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(at_once, Ordering::SeqCst);
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        let out = read.await;
        self.now.fetch_sub(1, Ordering::SeqCst);
        out
    }
}

#[async_trait]
impl Store for Counting {
    async fn claim(&self, r: &ClaimRequest) -> outbox_api::Result<Vec<Message>> {
        self.inner.claim(r).await
    }
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> outbox_api::Result<()> {
        self.inner.complete(ids, now).await
    }
    async fn fail(&self, f: &Failure) -> outbox_api::Result<FailOutcome> {
        self.inner.fail(f).await
    }
    async fn release(&self, r: &Release) -> outbox_api::Result<()> {
        self.inner.release(r).await
    }
    async fn release_worker(&self, w: &str) -> outbox_api::Result<u64> {
        self.inner.release_worker(w).await
    }
    async fn stats(&self) -> outbox_api::Result<Stats> {
        self.counted(self.inner.stats()).await
    }
    async fn backlog(&self) -> outbox_api::Result<Backlog> {
        self.counted(self.inner.backlog()).await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox_api::Result<u64> {
        self.inner.purge_processed(before, limit).await
    }
}

#[async_trait]
impl OperatorStore for Counting {
    async fn list(&self, q: &ListQuery) -> outbox_api::Result<Vec<Message>> {
        self.counted(self.inner.list(q)).await
    }
    async fn get(&self, id: MessageId) -> outbox_api::Result<Option<Message>> {
        self.inner.get(id).await
    }
    async fn retry(&self, id: MessageId, by: &str, now: Timestamp) -> outbox_api::Result<()> {
        self.inner.retry(id, by, now).await
    }
    async fn discard(&self, id: MessageId, by: &str, now: Timestamp) -> outbox_api::Result<()> {
        self.inner.discard(id, by, now).await
    }
    async fn activity_counts(
        &self,
        w: &outbox_api::activity::ActivityWindow,
    ) -> outbox_api::Result<outbox_api::activity::ActivityCounts> {
        self.inner.activity_counts(w).await
    }
}

/// The overview and the saga view read many outboxes side by side, but
/// never more at once than `read_concurrency` (default 8).
#[tokio::test]
async fn many_outboxes_are_read_a_few_at_a_time() {
    let now = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let backend = Backend::memory().await;
    backend.enqueue(vec![domain("A", "{}")]).await;
    let fleet = |console: Console| {
        (0..40).fold(console, |c, i| {
            let store = Counting {
                inner: backend.store(),
                now: now.clone(),
                most: most.clone(),
            };
            c.outbox(format!("t{i}"), Arc::new(store)).unwrap()
        })
    };
    let app = router(fleet(Console::new().read_concurrency(4)));
    for uri in ["/", "/traces/4bf92f3577b34da6a3ce929d0e0e4736"] {
        most.store(0, Ordering::SeqCst);
        let page = get(&app, uri).await;
        assert_eq!(page.status, StatusCode::OK, "{uri}: {}", page.body);
        assert_eq!(most.load(Ordering::SeqCst), 4, "{uri}");
        assert_eq!(now.load(Ordering::SeqCst), 0);
    }
    let app = router(fleet(Console::new()));
    most.store(0, Ordering::SeqCst);
    get(&app, "/").await;
    assert_eq!(
        most.load(Ordering::SeqCst),
        outbox_console::DEFAULT_READ_CONCURRENCY
    );
}
