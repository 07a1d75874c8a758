//! Who may drive the server from a browser: the `Host` and `Origin` rules.
//!
//! A web page the operator visits can send requests to a loopback server (a cross-site
//! `POST` needs no preflight when it has no JSON content type), and with DNS rebinding it can
//! even read the answers: its own host name resolves to 127.0.0.1, so the browser treats the
//! server as that page's origin. Both carry names the server does not answer to, so every
//! request is checked before routing:
//!
//! | header | accepted when | otherwise |
//! |---|---|---|
//! | `Host` | absent (not a browser), a loopback name or address (`localhost`, `*.localhost`, `127.0.0.0/8`, `[::1]`), the address the server is bound to, or a name in `serve.allowed_hosts` | 403, before routing |
//! | `Origin` | absent, or its host passes the `Host` rule | 403 |
//! | `Sec-Fetch-Site` | absent, `same-origin` or `none` (typed by the user) | 403 |
//!
//! The port is not compared: a loopback origin on another port is the operator's own machine.
//! Any process on the machine can reach a loopback server anyway; the admin token (required
//! off loopback) is what protects admin routes from it.

use std::net::IpAddr;

/// The names the server answers to, beyond loopback.
#[derive(Debug, Clone, Default)]
pub struct HostRule {
    /// The bound address, if not a wildcard.
    bound: Option<IpAddr>,
    /// `serve.allowed_hosts`, lower case, without ports.
    allowed: Vec<String>,
}

impl HostRule {
    /// The rule for a server bound to `bind` that also answers to `allowed` names.
    pub fn new(bind: &str, allowed: &[String]) -> HostRule {
        let bound = bind
            .parse::<std::net::SocketAddr>()
            .ok()
            .map(|a| a.ip())
            .filter(|ip| !ip.is_unspecified());
        HostRule {
            bound,
            allowed: allowed
                .iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .collect(),
        }
    }

    /// Whether a `Host` header value (`name[:port]`, `[v6]:port`) names this server.
    pub fn host_ok(&self, host: &str) -> bool {
        let Some(name) = host_name(host) else {
            return false;
        };
        if name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        let bare = name.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            if ip.is_loopback() || Some(ip) == self.bound {
                return true;
            }
        }
        self.allowed.iter().any(|a| a == &name || a == bare)
    }

    /// Whether an `Origin` header value (`scheme://host[:port]`, or `null`) is this server's.
    pub fn origin_ok(&self, origin: &str) -> bool {
        let Some((scheme, rest)) = origin.split_once("://") else {
            return false;
        };
        matches!(scheme, "http" | "https") && !rest.contains('/') && self.host_ok(rest)
    }

    /// The reason to refuse a request with these headers, if any.
    pub fn refuse(
        &self,
        host: Option<&str>,
        origin: Option<&str>,
        fetch_site: Option<&str>,
    ) -> Option<String> {
        if let Some(h) = host {
            if !self.host_ok(h) {
                return Some(format!(
                    "Host {h:?} is not this server's (loopback, the bound address, or serve.allowed_hosts)"
                ));
            }
        }
        if let Some(o) = origin {
            if !self.origin_ok(o) {
                return Some(format!("cross-site request from Origin {o:?} refused"));
            }
        }
        if let Some(s) = fetch_site {
            if !matches!(s, "same-origin" | "none") {
                return Some(format!("cross-site request (Sec-Fetch-Site: {s}) refused"));
            }
        }
        None
    }
}

/// The lower-case host name of a `Host` value, without its port; `None` if malformed.
fn host_name(host: &str) -> Option<String> {
    let host = host.trim().to_ascii_lowercase();
    if host.is_empty() || host.contains(['/', '@', ' ', '\\']) {
        return None;
    }
    let name = if host.starts_with('[') {
        let end = host.find(']')?;
        let (v6, rest) = host.split_at(end + 1);
        if !(rest.is_empty() || rest.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        v6.to_string()
    } else {
        match host.rsplit_once(':') {
            Some((n, p)) if is_port(p) => n.to_string(),
            Some(_) => return None,
            None => host,
        }
    };
    (!name.is_empty()).then_some(name)
}

fn is_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_bound_and_listed_hosts_pass_others_do_not() {
        let r = HostRule::new("127.0.0.1:8080", &["rag.internal".into()]);
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:8080",
            "LOCALHOST",
            "app.localhost:9",
            "[::1]:8080",
            "127.3.4.5:1",
            "rag.internal:8080",
        ] {
            assert!(r.host_ok(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "10.0.0.5:8080",
            "",
            "a@127.0.0.1",
            "127.0.0.1:80:80",
            "[::1",
            "127.0.0.1:http",
        ] {
            assert!(!r.host_ok(bad), "{bad}");
        }
        // The bound address passes when it is not a wildcard.
        let lan = HostRule::new("10.0.0.5:8080", &[]);
        assert!(lan.host_ok("10.0.0.5:8080"));
        assert!(!HostRule::new("0.0.0.0:8080", &[]).host_ok("10.0.0.5:8080"));
    }

    #[test]
    fn origins_and_fetch_metadata() {
        let r = HostRule::new("127.0.0.1:8080", &[]);
        assert!(r.origin_ok("http://127.0.0.1:8080"));
        assert!(r.origin_ok("http://localhost:3000"));
        for bad in [
            "https://evil.example",
            "null",
            "file://",
            "http://127.0.0.1:8080/x",
            "ftp://localhost",
        ] {
            assert!(!r.origin_ok(bad), "{bad}");
        }
        assert!(r.refuse(None, None, None).is_none());
        assert!(r
            .refuse(Some("127.0.0.1:8080"), None, Some("none"))
            .is_none());
        assert!(r
            .refuse(Some("127.0.0.1:8080"), None, Some("cross-site"))
            .is_some());
        assert!(r
            .refuse(Some("attacker.example:8080"), None, None)
            .unwrap()
            .contains("attacker.example"));
        assert!(r
            .refuse(None, Some("https://attacker.example"), None)
            .unwrap()
            .contains("Origin"));
    }
}
