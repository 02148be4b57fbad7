//! A plain HTTP/1.1 client over std's `TcpStream`: enough for `/metrics`, `/health`, the
//! OpenAI door's error cases (raw bodies, chunked replies) and Prometheus's query API.

use super::*;

/// A plain HTTP/1.1 request over std's TcpStream (`Connection: close`): status and body.
/// Enough for `/metrics`, `/health` and Prometheus's query API; no client library needed.
pub fn http(method: &str, url: &str, body: Option<(&str, &str)>) -> (u16, String) {
    let r = match body {
        Some((ctype, b)) => http_raw(method, url, &[("Content-Type", ctype)], Some(b.as_bytes())),
        None => http_raw(method, url, &[], None),
    };
    (r.status, r.body)
}

/// What [`http_raw`] got back.
#[derive(Debug, Clone)]
pub struct HttpReply {
    pub status: u16,
    /// The response head (status line and headers), as sent.
    pub head: String,
    pub body: String,
}

impl HttpReply {
    /// The value of response header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
}

/// An HTTP/1.1 request with exactly the given headers (plus Host, Connection: close and
/// Content-Length) and raw body bytes: for requests a client library would refuse to send.
pub fn http_raw(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpReply {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http:// url");
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut s =
        std::net::TcpStream::connect(host).unwrap_or_else(|e| panic!("connect {host}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    let mut bytes = Vec::new();
    if let Some(b) = body {
        req.push_str(&format!("Content-Length: {}\r\n\r\n", b.len()));
        bytes.extend_from_slice(req.as_bytes());
        bytes.extend_from_slice(b);
    } else {
        req.push_str("\r\n");
        bytes.extend_from_slice(req.as_bytes());
    }
    // A server may answer (413) and close before reading a large body: a failed write is
    // fine as long as the answer can be read.
    let _ = s.write_all(&bytes);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    HttpReply {
        status,
        head: head.to_string(),
        body,
    }
}

/// Decodes an HTTP/1.1 chunked body.
fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// `GET url`: status and body.
pub fn http_get(url: &str) -> (u16, String) {
    http("GET", url, None)
}

/// Percent-encodes a query-string value.
pub fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
