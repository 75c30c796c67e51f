//! A tiny threaded HTTP/1.1 server for fakes (a programmable indexer, an echoing replica, the
//! header-spoofing attacker): every request is counted and kept, and a handler picks the reply.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub delay: Duration,
    /// Headers besides `content-type` and `content-length`.
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    pub fn json(status: u16, v: &impl serde::Serialize) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            body: serde_json::to_vec(v).expect("a JSON body serialises"),
            delay: Duration::ZERO,
            headers: Vec::new(),
        }
    }
    pub fn text(status: u16, t: &str) -> Reply {
        Reply {
            status,
            content_type: "text/plain",
            body: t.as_bytes().to_vec(),
            delay: Duration::ZERO,
            headers: Vec::new(),
        }
    }
}

type Handler = dyn Fn(&Request) -> Reply + Send + Sync;

pub struct TestServer {
    pub port: u16,
    pub hits: Arc<AtomicUsize>,
    pub requests: Arc<Mutex<Vec<Request>>>,
}

impl TestServer {
    pub fn start(handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind test server");
        let port = listener.local_addr().expect("addr").port();
        let hits = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let (h2, r2) = (hits.clone(), requests.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (handler, hits, requests) = (handler.clone(), h2.clone(), r2.clone());
                thread::spawn(move || serve_conn(conn, &*handler, &hits, &requests));
            }
        });
        TestServer {
            port,
            hits,
            requests,
        }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

fn serve_conn(
    conn: TcpStream,
    handler: &Handler,
    hits: &AtomicUsize,
    requests: &Mutex<Vec<Request>>,
) {
    let _ = conn.set_nodelay(true);
    let Ok(write_half) = conn.try_clone() else {
        return;
    };
    let mut r = BufReader::new(conn);
    let mut w = write_half;
    loop {
        let Ok((line, headers)) = read_head(&mut r) else {
            return;
        };
        if line.is_empty() {
            return;
        }
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let path = parts.next().unwrap_or("").to_string();
        let Ok(body) = read_body(&mut r, &headers) else {
            return;
        };
        hits.fetch_add(1, Ordering::SeqCst);
        let req = Request {
            method,
            path,
            headers,
            body,
        };
        if let Ok(mut v) = requests.lock() {
            v.push(req.clone());
        }
        let reply = handler(&req);
        if !reply.delay.is_zero() {
            thread::sleep(reply.delay);
        }
        let mut head = format!(
            "HTTP/1.1 {} X\r\ncontent-type: {}\r\ncontent-length: {}\r\n",
            reply.status,
            reply.content_type,
            reply.body.len()
        );
        for (name, value) in &reply.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(&reply.body);
        if w.write_all(&bytes).is_err() {
            return;
        }
    }
}

fn read_head<R: BufRead>(r: &mut R) -> std::io::Result<(String, BTreeMap<String, String>)> {
    let mut first = String::new();
    r.read_line(&mut first)?;
    let mut headers = BTreeMap::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Ok((first.trim_end().to_string(), headers))
}

/// Reads a request body framed by chunked encoding or content-length (otherwise it has none).
fn read_body<R: BufRead>(
    r: &mut R,
    headers: &BTreeMap<String, String>,
) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    if headers
        .get("transfer-encoding")
        .is_some_and(|t| t.contains("chunked"))
    {
        loop {
            let mut size_line = String::new();
            r.read_line(&mut size_line)?;
            let size = usize::from_str_radix(size_line.trim().split(';').next().unwrap_or("0"), 16)
                .unwrap_or(0);
            if size == 0 {
                let mut end = String::new();
                r.read_line(&mut end)?;
                break;
            }
            let mut chunk = vec![0; size];
            r.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk);
            let mut crlf = [0; 2];
            r.read_exact(&mut crlf)?;
        }
    } else if let Some(len) = headers.get("content-length").and_then(|l| l.parse().ok()) {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    }
    Ok(body)
}

/// A stand-in replica that answers every request with its own address (early harness checks
/// only; the routing and fail-open tests use kvroute-sim).
pub fn echo_replica() -> TestServer {
    let slot: Arc<Mutex<u16>> = Arc::new(Mutex::new(0));
    let s2 = slot.clone();
    let server = TestServer::start(move |req| {
        let me = *s2.lock().expect("lock");
        Reply::json(
            200,
            &serde_json::json!({"served_by": me, "path": req.path, "saw_dst_header": req.headers.get("x-envoy-original-dst-host"),
                "body": String::from_utf8_lossy(&req.body),
                "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 3}}}),
        )
    });
    *slot.lock().expect("lock") = server.port;
    server
}
