//! The page frame, error and login pages, and formatting helpers.
//!
//! Templates are [maud]: every `(expr)` is HTML-escaped unless wrapped in
//! `PreEscaped`, which this crate never does with data from a store.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};
use outbox_api::Timestamp;

use crate::pages::State;

/// Most outboxes the navigation bar links to one by one; with more (a
/// fleet of tenants), it links to the overview, which filters and pages.
pub(crate) const NAV_OUTBOXES: usize = 10;

/// Most names a sentence lists before it says how many more there are.
pub(crate) const NAMES_SHOWN: usize = 10;

pub(crate) use outbox_api::backend::some_names;

/// A whole page: `title`, the navigation, `body`.
pub(crate) fn page(state: &State, title: &str, body: Markup) -> Markup {
    let p = &state.prefix;
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox console" }
                link rel="stylesheet" href={ (p) "/style.css" };
            }
            body {
                header {
                    nav {
                        a.brand href=(state.home()) { "outbox console" }
                        @let outboxes = state.outboxes();
                        @if outboxes.len() <= NAV_OUTBOXES {
                            @for o in outboxes.iter() {
                                " "
                                a href=(state.list_url(&o.name, "poisoned", None, 1)) { (o.name) }
                            }
                        } @else {
                            " "
                            a href=(state.home()) { (outboxes.len()) " outboxes" }
                        }
                    }
                    @if state.keys.token_required() {
                        form.logout method="post" action={ (p) "/logout" } {
                            input type="hidden" name="csrf" value=(state.keys.csrf("logout", "", ""));
                            button type="submit" { "Log out" }
                        }
                    }
                }
                main {
                    (body)
                }
            }
        }
    }
}

/// A response of `status` with a page.
pub(crate) fn respond(status: StatusCode, markup: Markup) -> Response {
    (status, Html(markup.into_string())).into_response()
}

/// A page explaining a refusal or an error, with a way back.
pub(crate) fn error_page(state: &State, status: StatusCode, title: &str, detail: &str) -> Response {
    let body = html! {
        h1 { (title) }
        p.error { (detail) }
        p { a href=(state.home()) { "Back to the overview" } }
    };
    respond(status, page_without_nav(state, title, body))
}

/// The frame without the outbox links (used before login, where the
/// outbox names are not shown to strangers).
fn page_without_nav(state: &State, title: &str, body: Markup) -> Markup {
    let p = &state.prefix;
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox console" }
                link rel="stylesheet" href={ (p) "/style.css" };
            }
            body {
                header { nav { a.brand href=(state.home()) { "outbox console" } } }
                main { (body) }
            }
        }
    }
}

/// The login form, with `problem` above it if the last try failed.
pub(crate) fn login_page(state: &State, status: StatusCode, problem: Option<&str>) -> Response {
    let p = &state.prefix;
    let body = html! {
        h1 { "Log in" }
        @if let Some(problem) = problem {
            p.error { (problem) }
        } @else {
            p { "This console needs its token (or send it as " code { "Authorization: Bearer" } ")." }
        }
        form method="post" action={ (p) "/login" } {
            label { "Token " input type="password" name="token" autocomplete="current-password" required; }
            " "
            button type="submit" { "Log in" }
        }
    };
    respond(status, page_without_nav(state, "Log in", body))
}

/// `1d 2h`, `3h`, `5m 6s`, `7s`, `120ms`: the ages of the relay and the CLI.
pub(crate) use outbox_api::format_age as age;

/// A time with its age: `2024-… (5m 3s ago)`.
pub(crate) fn when(t: Timestamp, now: Timestamp) -> String {
    if t <= now {
        format!("{t} ({} ago)", age(now.since(t)))
    } else {
        format!("{t} (in {})", age(t.since(now)))
    }
}

/// At most `max` characters of `s`, with `…` if cut.
pub(crate) fn short(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// Largest payload shown in full on a detail page.
const MAX_SHOWN_PAYLOAD: usize = 256 * 1024;

/// A payload for reading: pretty JSON if it parses, UTF-8 text if it is,
/// else a hex dump; cut at 256 KiB. The second value says what was done.
pub(crate) fn payload(bytes: &[u8]) -> (String, String) {
    let (shown, cut) = if bytes.len() > MAX_SHOWN_PAYLOAD {
        (&bytes[..MAX_SHOWN_PAYLOAD], true)
    } else {
        (bytes, false)
    };
    let size = format!("{} bytes", bytes.len());
    if !cut && serde_json::from_slice::<serde_json::Value>(bytes).is_ok() {
        if let Ok(text) = std::str::from_utf8(bytes) {
            return (pretty_json(text), format!("{size}, JSON (pretty-printed)"));
        }
    }
    let note = if cut {
        format!("{size}; the first {MAX_SHOWN_PAYLOAD} shown")
    } else {
        size
    };
    match std::str::from_utf8(shown) {
        Ok(text) => (text.to_owned(), format!("{note}, text")),
        Err(e) if cut && e.error_len().is_none() => (
            String::from_utf8_lossy(&shown[..e.valid_up_to()]).into_owned(),
            format!("{note}, text"),
        ),
        Err(_) => {
            let mut out = String::new();
            for (i, chunk) in shown.chunks(16).enumerate() {
                out.push_str(&format!("{:08x} ", i * 16));
                for b in chunk {
                    out.push_str(&format!(" {b:02x}"));
                }
                out.push('\n');
            }
            (out, format!("{note}, binary (hex)"))
        }
    }
}

/// Re-indents valid JSON `text` two spaces a level, keeping its members'
/// order and its strings and numbers exactly as written (parsing into a
/// map would sort the keys).
pub(crate) fn pretty_json(text: &str) -> String {
    fn newline(out: &mut String, depth: usize) {
        out.push('\n');
        out.extend(std::iter::repeat_n("  ", depth));
    }
    let mut out = String::with_capacity(text.len() * 2);
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.peek().is_some_and(|c| c.is_whitespace()) {
                    chars.next();
                }
                if chars.peek().is_some_and(|n| matches!(n, '}' | ']')) {
                    out.push(chars.next().unwrap_or(' '));
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    out
}

/// The stylesheet: plain, readable, no external fonts.
pub(crate) const STYLE: &str = r#"
body { font: 15px/1.45 system-ui, sans-serif; margin: 0; color: #1d2430; background: #f6f7f9; }
header { display: flex; justify-content: space-between; align-items: center; background: #1d2430; padding: .5rem 1.2rem; }
header a { color: #dfe6f0; margin-right: 1rem; text-decoration: none; }
header a.brand { font-weight: 700; color: #fff; }
header form { margin: 0; }
main { padding: 1rem 1.2rem 3rem; max-width: 78rem; }
h1 { font-size: 1.4rem; margin: .5rem 0 1rem; }
h2 { font-size: 1.1rem; margin-top: 1.6rem; }
table { border-collapse: collapse; background: #fff; width: 100%; margin: .5rem 0; }
th, td { text-align: left; padding: .35rem .6rem; border-bottom: 1px solid #e3e6eb; vertical-align: top; }
th { background: #eef1f5; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, monospace; font-size: 13px; }
pre { background: #fff; border: 1px solid #e3e6eb; padding: .8rem; overflow: auto; max-height: 40rem; white-space: pre-wrap; word-break: break-all; }
.status { font-weight: 700; padding: .1rem .45rem; border-radius: .3rem; }
.healthy { background: #d8f3dc; color: #1b5e20; }
.degraded { background: #fff3cd; color: #7a5200; }
.unhealthy, .unavailable { background: #f8d7da; color: #842029; }
.error { color: #842029; }
.note { color: #5b6472; font-size: .9rem; }
.flash { background: #d8f3dc; padding: .5rem .8rem; border-radius: .3rem; }
.actions form { display: inline; }
form.actions a { margin-left: .8rem; }
button { font: inherit; padding: .3rem .8rem; border: 1px solid #8a93a3; border-radius: .3rem; background: #fff; cursor: pointer; }
button.danger { border-color: #b02a37; color: #b02a37; }
button.primary { border-color: #1d4ed8; color: #1d4ed8; }
nav.tabs a { margin-right: 1rem; }
nav.tabs a.current { font-weight: 700; text-decoration: none; color: inherit; }
.pager a { margin-right: 1rem; }
.summary a { margin-right: .2rem; }
form.filter { margin: .6rem 0; }
form.filter label { margin-right: .8rem; }
figure.chart { background: #fff; border: 1px solid #e3e6eb; margin: .8rem 0; padding: .6rem .8rem; max-width: 48rem; }
figure.chart figcaption { font-weight: 600; }
figure.chart svg { width: 100%; height: auto; }
figure.chart .legend { margin: .2rem 0 0; font-size: .9rem; }
figure.chart .legend .key { margin-right: 1.2rem; }
figure.chart .legend svg { width: 12px; height: 12px; vertical-align: -1px; }
"#;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn pretty_json_keeps_order_and_strings() {
        let text = r#"{"z":1, "a":{"s":"x, {y}: \\\" ]","e":[],"o":{ }},"n":[1,2.50]}"#;
        let want = "{\n  \"z\": 1,\n  \"a\": {\n    \"s\": \"x, {y}: \\\\\\\" ]\",\n    \"e\": [],\n    \"o\": {}\n  },\n  \"n\": [\n    1,\n    2.50\n  ]\n}";
        assert_eq!(pretty_json(text), want);
        let reparsed: serde_json::Value = serde_json::from_str(&pretty_json(text)).unwrap();
        assert_eq!(
            reparsed,
            serde_json::from_str::<serde_json::Value>(text).unwrap()
        );
    }

    #[test]
    fn payload_kinds() {
        assert!(payload(b"{\"a\":1}").1.contains("JSON"));
        assert_eq!(payload(b"plain <text>").0, "plain <text>");
        assert!(payload(&[0xff, 0x00, 0x10]).0.contains("ff 00 10"));
        let big = vec![b'a'; MAX_SHOWN_PAYLOAD + 10];
        let (shown, note) = payload(&big);
        assert_eq!(shown.len(), MAX_SHOWN_PAYLOAD);
        assert!(note.contains("first"), "{note}");
    }

    #[test]
    fn names_are_cut_with_a_count() {
        assert_eq!(some_names(&["a", "b"], 10), "a, b");
        assert_eq!(some_names(&["a", "b", "c"], 2), "a, b and 1 more");
        assert_eq!(some_names::<&str>(&[], 2), "");
    }

    #[test]
    fn ages() {
        assert_eq!(age(Duration::from_millis(120)), "120ms");
        assert_eq!(age(Duration::from_secs(65)), "1m 5s");
        assert_eq!(age(Duration::from_secs(3 * 86_400 + 7200)), "3d 2h");
    }
}
