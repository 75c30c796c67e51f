//! The workspace's one blocking HTTP/1.1 client, for loopback: one request per connection
//! (`Connection: close`), `Content-Length` or chunked response bodies, read incrementally so a
//! streaming (SSE) response can be timed token by token ([`request`]), or whole ([`try_http`],
//! [`http`] for tests). Enough for talking to the replicas, the indexer and Envoy on 127.0.0.1;
//! not a general-purpose client (no TLS, no redirects). Requests are sent as given: a caller may
//! set its own `content-length` or `transfer-encoding` (hostile-input tests do).

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Longest status line or header line accepted.
const MAX_LINE: usize = 16 * 1024;
/// Most header lines accepted.
const MAX_HEADERS: usize = 200;

/// Largest body [`try_http`] reads.
const MAX_FULL_BODY: usize = 256 << 20;

/// A response whose body has not been read yet.
pub struct Response {
    /// The status code.
    pub status: u16,
    headers: Vec<(String, String)>,
    body: Body,
}

impl Response {
    /// The headers, names lower-cased, in the order received.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// Reads the whole body (at most `limit` bytes).
    pub fn into_full(mut self, limit: usize) -> Result<FullResponse> {
        let mut body = Vec::new();
        (&mut self.body)
            .take(limit as u64 + 1)
            .read_to_end(&mut body)
            .context("reading response body")?;
        if body.len() > limit {
            bail!("response body larger than {limit} bytes");
        }
        Ok(FullResponse {
            status: self.status,
            headers: self.headers.into_iter().collect(),
            body,
        })
    }

    /// The body, decoded from its transfer encoding, as a stream.
    pub fn body(&mut self) -> &mut impl BufRead {
        &mut self.body
    }

    /// Reads the whole body (at most `limit` bytes) as text.
    pub fn text(self, limit: usize) -> Result<String> {
        Ok(self.into_full(limit)?.text())
    }
}

/// Sends one request to `addr` (`host:port`) and reads the status line and headers.
/// `timeout` bounds connecting and every single read or write, not the whole exchange.
pub fn request(
    method: &str,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response> {
    let socket = resolve(addr)?;
    let stream = TcpStream::connect_timeout(&socket, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;

    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    let mut framed = false;
    for (name, value) in headers {
        if name.contains(['\r', '\n', ':']) || value.contains(['\r', '\n']) {
            bail!("invalid header {name:?}");
        }
        framed |= name.eq_ignore_ascii_case("content-length")
            || name.eq_ignore_ascii_case("transfer-encoding");
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !(framed || (body.is_empty() && matches!(method, "GET" | "HEAD"))) {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut writer = &stream;
    writer
        .write_all(head.as_bytes())
        .and_then(|()| writer.write_all(body))
        .and_then(|()| writer.flush())
        .with_context(|| format!("sending {method} {path} to {addr}"))?;

    let mut reader = BufReader::new(stream);
    let status_line = read_line(&mut reader)?;
    let status = parse_status(&status_line)?;
    let mut headers = Vec::new();
    loop {
        let line = read_line(&mut reader)?;
        if line.is_empty() {
            break;
        }
        if headers.len() == MAX_HEADERS {
            bail!("more than {MAX_HEADERS} response headers");
        }
        let Some((name, value)) = line.split_once(':') else {
            bail!("malformed response header {line:?}");
        };
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    let length = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map(|(_, v)| v.parse::<u64>())
        .transpose()
        .context("malformed content-length")?;
    let mode = if method == "HEAD" || status == 204 || status == 304 {
        Mode::Length(0)
    } else if chunked {
        Mode::Chunked {
            remaining: 0,
            done: false,
        }
    } else if let Some(n) = length {
        Mode::Length(n)
    } else {
        Mode::UntilClose
    };
    Ok(Response {
        status,
        headers,
        body: Body {
            inner: reader,
            mode,
            buf: Vec::new(),
            pos: 0,
        },
    })
}

/// POSTs `body` to `addr` and fails, showing the status and the start of the body, unless the
/// answer is 200; the body is left to read (a stream).
pub fn post_ok(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response> {
    let resp = request("POST", addr, path, headers, body, timeout)?;
    if resp.status != 200 {
        let status = resp.status;
        let text = resp.text(4096).unwrap_or_default();
        bail!("HTTP {status}: {}", text.trim());
    }
    Ok(resp)
}

/// `GET addr path`, returning status and body text (at most 8 MiB).
pub fn get(addr: &str, path: &str, timeout: Duration) -> Result<(u16, String)> {
    let resp = request("GET", addr, path, &[], &[], timeout)?;
    let status = resp.status;
    Ok((status, resp.text(8 << 20)?))
}

/// A whole response: status, headers (names lower-cased) and body.
#[derive(Debug, Clone)]
pub struct FullResponse {
    /// The status code.
    pub status: u16,
    /// The headers by lower-cased name (the last of repeated ones).
    pub headers: BTreeMap<String, String>,
    /// The decoded body.
    pub body: Vec<u8>,
}

impl FullResponse {
    /// The body as JSON; panics showing the body when it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A header by lower-case name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// One request to `127.0.0.1:port`, the whole response read; `timeout` bounds every step.
pub fn try_http(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<FullResponse> {
    request(
        method,
        &format!("127.0.0.1:{port}"),
        path,
        headers,
        body,
        timeout,
    )?
    .into_full(MAX_FULL_BODY)
}

/// [`try_http`] with a 60 s timeout, panicking on failure (tests).
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> FullResponse {
    try_http(port, method, path, headers, body, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{method} 127.0.0.1:{port}{path}: {e:#}"))
}

/// POSTs JSON to `127.0.0.1:port` with extra headers, panicking on failure (tests).
pub fn post_json(
    port: u16,
    path: &str,
    body: &serde_json::Value,
    extra: &[(&str, &str)],
) -> FullResponse {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(extra);
    http(port, "POST", path, &h, body.to_string().as_bytes())
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("bad address {addr:?}"))?
        .next()
        .with_context(|| format!("address {addr:?} resolves to nothing"))
}

fn read_line(reader: &mut impl BufRead) -> Result<String> {
    let mut line = Vec::new();
    let n = reader
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut line)
        .context("reading response")?;
    if n == 0 {
        bail!("connection closed before the response was complete");
    }
    if line.len() > MAX_LINE {
        bail!("response line longer than {MAX_LINE} bytes");
    }
    while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        line.pop();
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

fn parse_status(line: &str) -> Result<u16> {
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next().map(str::parse::<u16>)) {
        (Some(version), Some(Ok(code))) if version.starts_with("HTTP/1.") => Ok(code),
        _ => bail!("malformed status line {line:?}"),
    }
}

enum Mode {
    Length(u64),
    Chunked { remaining: u64, done: bool },
    UntilClose,
}

/// The response body with its transfer encoding removed.
struct Body {
    inner: BufReader<TcpStream>,
    mode: Mode,
    buf: Vec<u8>,
    pos: usize,
}

impl Body {
    /// Reads the next piece of decoded body into `self.buf`; an empty buffer means the end.
    fn refill(&mut self) -> io::Result<()> {
        self.buf.clear();
        self.pos = 0;
        match &mut self.mode {
            Mode::Length(0) => Ok(()),
            Mode::Length(remaining) => read_counted(
                &mut self.inner,
                &mut self.buf,
                remaining,
                "the response body",
            ),
            Mode::UntilClose => {
                self.buf.resize(64 * 1024, 0);
                let n = self.inner.read(&mut self.buf)?;
                self.buf.truncate(n);
                Ok(())
            }
            Mode::Chunked { remaining, done } => {
                if *done {
                    return Ok(());
                }
                if *remaining == 0 {
                    let size_line = read_line(&mut self.inner).map_err(io::Error::other)?;
                    let size_hex = size_line.split(';').next().unwrap_or("").trim();
                    let size = u64::from_str_radix(size_hex, 16).map_err(|_| {
                        io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("bad chunk size {size_line:?}"),
                        )
                    })?;
                    if size == 0 {
                        // Trailers, then the final empty line.
                        loop {
                            let trailer = read_line(&mut self.inner).map_err(io::Error::other)?;
                            if trailer.is_empty() {
                                break;
                            }
                        }
                        *done = true;
                        return Ok(());
                    }
                    *remaining = size;
                }
                read_counted(&mut self.inner, &mut self.buf, remaining, "a chunk")?;
                if *remaining == 0 {
                    let crlf = read_line(&mut self.inner).map_err(io::Error::other)?;
                    if !crlf.is_empty() {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "chunk not followed by CRLF",
                        ));
                    }
                }
                Ok(())
            }
        }
    }
}

/// Reads at most 64 KiB of the `remaining` bytes into `buf`, counting them off; the connection
/// closing first is an error naming what it was `inside`.
fn read_counted(
    inner: &mut BufReader<TcpStream>,
    buf: &mut Vec<u8>,
    remaining: &mut u64,
    inside: &str,
) -> io::Result<()> {
    buf.resize((*remaining).min(64 * 1024) as usize, 0);
    let n = inner.read(buf)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("connection closed inside {inside}"),
        ));
    }
    buf.truncate(n);
    *remaining -= n as u64;
    Ok(())
}

impl Read for Body {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let available = self.fill_buf()?;
        let n = available.len().min(out.len());
        out[..n].copy_from_slice(&available[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for Body {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.pos >= self.buf.len() {
            self.refill()?;
        }
        Ok(&self.buf[self.pos..])
    }

    fn consume(&mut self, amt: usize) {
        self.pos = (self.pos + amt).min(self.buf.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;

    /// Serves one connection with a canned response, returning the request it received.
    fn serve_once(response: &'static [u8]) -> (String, thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let handle = thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut reader = BufReader::new(conn.try_clone().expect("clone"));
            let mut request = String::new();
            let mut content_length = 0usize;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).expect("read");
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    content_length = v.trim().parse().expect("length");
                }
                request.push_str(&line);
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0; content_length];
            reader.read_exact(&mut body).expect("body");
            request.push_str(&String::from_utf8_lossy(&body));
            conn.write_all(response).expect("write");
            request
        });
        (addr, handle)
    }

    #[test]
    fn reads_a_content_length_body_and_sends_the_request_body() {
        let (addr, server) =
            serve_once(b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello");
        let resp = request(
            "POST",
            &addr,
            "/v1/x",
            &[("content-type", "application/json")],
            b"{\"k\":1}",
            Duration::from_secs(5),
        )
        .expect("request");
        assert_eq!(resp.status, 201);
        assert_eq!(resp.text(100).expect("body"), "hello");
        let request = server.join().expect("server");
        assert!(request.starts_with("POST /v1/x HTTP/1.1\r\n"), "{request}");
        assert!(request.ends_with("\r\n\r\n{\"k\":1}"), "{request}");
    }

    #[test]
    fn decodes_chunked_bodies_line_by_line() {
        let (addr, _server) = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
              7\r\ndata: a\r\n\
              3\r\n\n\nd\r\n\
              a;ext=1\r\nata: [DONE\r\n\
              3\r\n]\n\n\r\n\
              0\r\nTrailer: x\r\n\r\n",
        );
        let mut resp = request("GET", &addr, "/", &[], &[], Duration::from_secs(5)).expect("get");
        assert_eq!(resp.status, 200);
        let lines: Vec<String> = resp
            .body()
            .lines()
            .collect::<io::Result<_>>()
            .expect("lines");
        assert_eq!(lines, ["data: a", "", "data: [DONE]", ""]);
    }

    #[test]
    fn reads_until_close_without_length() {
        let (addr, _server) = serve_once(b"HTTP/1.0 500 Oops\r\n\r\nbroken");
        let (status, body) = get(&addr, "/", Duration::from_secs(5)).expect("get");
        assert_eq!((status, body.as_str()), (500, "broken"));
    }

    #[test]
    fn truncated_bodies_are_errors() {
        let (addr, _server) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort");
        assert!(get(&addr, "/", Duration::from_secs(5)).is_err());
        let (addr, _server) =
            serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab");
        assert!(get(&addr, "/", Duration::from_secs(5)).is_err());
    }

    #[test]
    fn garbage_status_lines_are_errors() {
        let (addr, _server) = serve_once(b"SSH-2.0-OpenSSH\r\n\r\n");
        assert!(get(&addr, "/", Duration::from_secs(5)).is_err());
    }
}
