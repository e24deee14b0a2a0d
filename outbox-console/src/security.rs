//! Who may use the console: loopback peers without a token, token holders
//! with one; CSRF tokens for actions; headers that forbid scripts and
//! framing.
// A refusal is a ready page (`Response`), returned early with `?`; its
// size does not matter on a path that renders HTML.
#![allow(clippy::result_large_err)]

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State as AxumState};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::SESSION_COOKIE;
use crate::pages::State;
use crate::view;

/// The environment variable [`Console::token_from_env`](crate::Console::token_from_env)
/// reads the token from.
pub const TOKEN_ENV: &str = "OUTBOX_CONSOLE_TOKEN";

type HmacSha256 = Hmac<Sha256>;

/// Secrets of this process: a random key (new at every start) and the
/// token, if any. Everything compared is first MAC'd with the key, so that
/// comparisons are of equal length and in constant time.
pub(crate) struct Keys {
    key: [u8; 32],
    token_mac: Option<[u8; 32]>,
}

impl Keys {
    pub(crate) fn new(token: Option<&str>) -> Self {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the operating system's random source failed");
        let mut keys = Keys {
            key,
            token_mac: None,
        };
        keys.token_mac = token.map(|t| keys.mac(&[b"token", t.as_bytes()]));
        keys
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut m = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        for p in parts {
            // Length-prefixed, so that ("ab", "c") and ("a", "bc") differ.
            m.update(&(p.len() as u64).to_be_bytes());
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    pub(crate) fn token_required(&self) -> bool {
        self.token_mac.is_some()
    }

    /// Whether `presented` is the token (constant time).
    pub(crate) fn is_token(&self, presented: &str) -> bool {
        match &self.token_mac {
            Some(expected) => {
                let got = self.mac(&[b"token", presented.as_bytes()]);
                bool::from(got.ct_eq(expected))
            }
            None => false,
        }
    }

    /// The session cookie's value: derived from the token and this
    /// process's key, so it reveals neither and ends with the process.
    pub(crate) fn session_value(&self) -> Option<String> {
        self.token_mac.map(|t| hex(&self.mac(&[b"session", &t])))
    }

    fn is_session(&self, presented: &str) -> bool {
        match self.session_value() {
            Some(expected) => bool::from(presented.as_bytes().ct_eq(expected.as_bytes())),
            None => false,
        }
    }

    /// The CSRF token for one action on one target (an id, a type, or
    /// `""`), as put in the confirmation form.
    pub(crate) fn csrf(&self, action: &str, outbox: &str, target: &str) -> String {
        hex(&self.mac(&[
            b"csrf",
            action.as_bytes(),
            outbox.as_bytes(),
            target.as_bytes(),
        ]))
    }

    /// Whether `presented` is the CSRF token for that action (constant time).
    pub(crate) fn csrf_ok(
        &self,
        presented: &str,
        action: &str,
        outbox: &str,
        target: &str,
    ) -> bool {
        let expected = self.csrf(action, outbox, target);
        bool::from(presented.as_bytes().ct_eq(expected.as_bytes()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `host` (a Host header, with or without port) names this machine
/// by a loopback name or address.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [::1]:8080
        match rest.split_once(']') {
            Some((ip, _)) => ip,
            None => return false,
        }
    } else {
        host.rsplit_once(':').map_or(host, |(h, _)| h)
    };
    name.eq_ignore_ascii_case("localhost")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn header_str(headers: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// Whether a POST comes from a page of this console's own origin, as far
/// as the browser tells: `Sec-Fetch-Site` when sent, else `Origin` against
/// `Host` (`Origin: null` is refused). A request with neither (not a browser) is left to the CSRF token.
fn same_origin(headers: &HeaderMap) -> Result<(), &'static str> {
    // Browsers send Sec-Fetch-Site themselves and no page can set it; when
    // present it decides (`Origin` may be `null` under some referrer policies).
    if let Some(site) = header_str(headers, header::HeaderName::from_static("sec-fetch-site")) {
        return match site {
            "same-origin" | "none" => Ok(()),
            _ => Err("the request came from another site (Sec-Fetch-Site)"),
        };
    }
    if let Some(origin) = header_str(headers, header::ORIGIN) {
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        let host = header_str(headers, header::HOST);
        match (authority, host) {
            (Some(a), Some(h)) if a.eq_ignore_ascii_case(h) => {}
            _ => return Err("the request's Origin is not this console's host"),
        }
    }
    Ok(())
}

/// The middleware in front of every console route.
pub(crate) async fn guard(
    AxumState(state): AxumState<Arc<State>>,
    req: Request,
    next: Next,
) -> Response {
    let mut response = match check(&state, &req) {
        Ok(()) => next.run(req).await,
        Err(refusal) => refusal,
    };
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn check(state: &State, req: &Request) -> Result<(), Response> {
    let headers = req.headers();
    // The console's routes are nested under its prefix, so paths here are
    // relative to it.
    let path = req.uri().path();
    let open_path = path == "/login" || path == "/style.css";
    if state.keys.token_required() {
        let bearer = header_str(headers, header::AUTHORIZATION)
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| state.keys.is_token(t.trim()));
        let session = cookie(headers, SESSION_COOKIE).is_some_and(|c| state.keys.is_session(c));
        if !(bearer || session || open_path) {
            let mut r = view::login_page(state, StatusCode::UNAUTHORIZED, None);
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"outbox console\""),
            );
            return Err(r);
        }
    } else {
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0);
        match peer {
            Some(p) if p.ip().is_loopback() => {}
            Some(p) => {
                tracing::warn!(peer = %p, "outbox console refused a non-loopback peer (no token set)");
                return Err(view::error_page(
                    state,
                    StatusCode::FORBIDDEN,
                    "Forbidden",
                    "This console has no token, so it answers only on loopback (127.0.0.1, ::1). \
                     Set a token to use it from elsewhere.",
                ));
            }
            None => {
                return Err(view::error_page(
                    state,
                    StatusCode::FORBIDDEN,
                    "Forbidden",
                    "This console has no token, so it answers only loopback peers, and it cannot \
                     tell who the peer is: serve the application with \
                     into_make_service_with_connect_info::<SocketAddr>(), or set a token.",
                ));
            }
        }
        // A page of another site whose name resolves to 127.0.0.1 (DNS
        // rebinding) would otherwise read these pages as same-origin.
        if !header_str(headers, header::HOST).is_some_and(is_loopback_host) {
            return Err(view::error_page(
                state,
                StatusCode::FORBIDDEN,
                "Forbidden",
                "This console has no token, so it answers only when addressed as localhost, \
                 127.0.0.1 or [::1].",
            ));
        }
    }
    if req.method() == Method::POST {
        if let Err(why) = same_origin(headers) {
            return Err(view::error_page(
                state,
                StatusCode::FORBIDDEN,
                "Refused: cross-site request",
                why,
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        for h in [
            "localhost",
            "localhost:80",
            "127.0.0.1:9",
            "127.1.2.3",
            "[::1]:8080",
            "[::1]",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "example.com",
            "evil.localhost.example.com:80",
            "10.0.0.1",
            "[::2]:1",
            "[::1",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn token_and_csrf_comparisons() {
        let keys = Keys::new(Some("0123456789abcdef-token"));
        assert!(keys.is_token("0123456789abcdef-token"));
        assert!(!keys.is_token("0123456789abcdef-toke"));
        assert!(!keys.is_token(""));
        let session = keys.session_value().unwrap();
        assert!(keys.is_session(&session));
        assert!(
            !session.contains("token"),
            "the cookie does not carry the token"
        );
        let t = keys.csrf("retry", "orders", "id-1");
        assert!(keys.csrf_ok(&t, "retry", "orders", "id-1"));
        assert!(
            !keys.csrf_ok(&t, "discard", "orders", "id-1"),
            "bound to the action"
        );
        assert!(
            !keys.csrf_ok(&t, "retry", "orders", "id-2"),
            "bound to the target"
        );
        assert!(
            !Keys::new(None).csrf_ok(&t, "retry", "orders", "id-1"),
            "bound to the process"
        );
    }
}
