//! Signing in with the console's token, and out.

use super::*;

/// `GET {prefix}/login`.
pub(crate) async fn login_form(S(st): S<Arc<State>>) -> Response {
    if !st.keys.token_required() {
        return Redirect::to(&st.home()).into_response();
    }
    view::login_page(&st, StatusCode::OK, None)
}

fn cookie_path(st: &State) -> &str {
    if st.prefix.is_empty() {
        "/"
    } else {
        &st.prefix
    }
}

/// `POST {prefix}/login`: checks the token, sets the session cookie.
pub(crate) async fn login(S(st): S<Arc<State>>, ext: Extensions, body: Bytes) -> Response {
    let Some(session) = st.keys.session_value() else {
        return Redirect::to(&st.home()).into_response();
    };
    let f = form(&body);
    if !st.keys.is_token(param(&f, "token").unwrap_or("")) {
        let peer = ext
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip().to_string())
            .unwrap_or_else(|| "unknown".to_owned());
        tracing::warn!(%peer, "outbox console: login with a wrong token");
        return view::login_page(
            &st,
            StatusCode::UNAUTHORIZED,
            Some("That is not the console's token."),
        );
    }
    let cookie = format!(
        "{SESSION_COOKIE}={session}; Path={}; HttpOnly; SameSite=Strict",
        cookie_path(&st)
    );
    let mut r = Redirect::to(&st.home()).into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

/// `POST {prefix}/logout`: clears the cookie.
pub(crate) async fn logout(S(st): S<Arc<State>>, body: Bytes) -> Response {
    let f = form(&body);
    if !st
        .keys
        .csrf_ok(param(&f, "csrf").unwrap_or(""), "logout", "", "")
    {
        return csrf_refused(&st);
    }
    let cookie = format!(
        "{SESSION_COOKIE}=; Path={}; HttpOnly; SameSite=Strict; Max-Age=0",
        cookie_path(&st)
    );
    let mut r = Redirect::to(&format!("{}/login", st.prefix)).into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}
