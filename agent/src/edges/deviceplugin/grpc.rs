//! gRPC over HTTP/2 on a unix socket, as much as the kubelet's two APIs need: unary calls
//! both ways and one server stream (`ListAndWatch`). Messages are length-prefixed
//! (1 byte compression flag, always 0 here; 4 bytes big-endian length), status in the
//! `grpc-status` trailer.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use tokio::net::{UnixListener, UnixStream};

/// Largest message taken (the kubelet's are a few kilobytes).
pub const MAX_MESSAGE: usize = 4 << 20;

/// A gRPC status other than OK.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("gRPC status {code}: {message}")]
pub struct Status {
    /// The code (3 invalid argument, 9 failed precondition, 12 unimplemented, 13 internal,
    /// 14 unavailable).
    pub code: u32,
    /// Why.
    pub message: String,
}

impl Status {
    /// A status with `code`.
    pub fn new(code: u32, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
        }
    }
}

/// What a call answers: one message, or a stream that sends one message and then stays
/// open until `until` completes (`ListAndWatch`).
pub enum Reply {
    /// A unary answer.
    Unary(Vec<u8>),
    /// A server stream's first message, held open until the future completes.
    Hold(Vec<u8>, Pin<Box<dyn Future<Output = ()> + Send>>),
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reply::Unary(m) => write!(f, "Unary({} bytes)", m.len()),
            Reply::Hold(m, _) => write!(f, "Hold({} bytes)", m.len()),
        }
    }
}

/// Answers calls by path (`/package.Service/Method`) and request message.
pub type Handler = Arc<dyn Fn(&str, &[u8]) -> Result<Reply, Status> + Send + Sync>;

fn frame(msg: &[u8]) -> Bytes {
    let mut b = Vec::with_capacity(5 + msg.len());
    b.push(0);
    b.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    b.extend_from_slice(msg);
    Bytes::from(b)
}

/// Reads a whole body and takes its one message.
async fn one_message(body: &mut h2::RecvStream) -> Result<Vec<u8>, Status> {
    let mut buf = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| Status::new(13, format!("reading the request: {e}")))?;
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        if buf.len() > MAX_MESSAGE + 5 {
            return Err(Status::new(8, "message too large"));
        }
    }
    unframe(&buf)
}

fn unframe(buf: &[u8]) -> Result<Vec<u8>, Status> {
    if buf.is_empty() {
        return Ok(Vec::new());
    }
    if buf.len() < 5 {
        return Err(Status::new(13, "truncated gRPC frame"));
    }
    if buf[0] != 0 {
        return Err(Status::new(12, "compressed messages are not supported"));
    }
    let n = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if buf.len() != 5 + n {
        return Err(Status::new(13, "gRPC frame length does not match the body"));
    }
    Ok(buf[5..].to_vec())
}

fn status_headers(code: u32, message: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("grpc-status", HeaderValue::from(code));
    if !message.is_empty() {
        // Percent-encoding is only needed outside printable ASCII.
        let clean: String = message
            .chars()
            .map(|c| {
                if c.is_ascii_graphic() || c == ' ' {
                    c
                } else {
                    '?'
                }
            })
            .collect();
        if let Ok(v) = HeaderValue::from_str(&clean) {
            h.insert("grpc-message", v);
        }
    }
    h
}

/// Connections served at once (the kubelet keeps one or two).
pub const MAX_CONNECTIONS: usize = 8;
/// Calls in flight per connection.
pub const MAX_STREAMS: u32 = 16;
/// How long a new connection may take to say hello.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `handler` on `listener` until the listener fails: at most [`MAX_CONNECTIONS`]
/// connections (more wait), [`MAX_STREAMS`] calls each; the handler runs on a blocking
/// thread (it may touch the file system).
pub async fn serve(listener: UnixListener, handler: Handler) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let hello = h2::server::Builder::new()
                .max_concurrent_streams(MAX_STREAMS)
                .max_header_list_size(16 << 10)
                .handshake(stream);
            let Ok(Ok(mut conn)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, hello).await else {
                return;
            };
            while let Some(Ok((req, respond))) = conn.accept().await {
                let handler = handler.clone();
                tokio::spawn(call(req, respond, handler));
            }
        });
    }
}

async fn call(
    req: Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    handler: Handler,
) {
    let path = req.uri().path().to_string();
    let mut body = req.into_body();
    let reply = match one_message(&mut body).await {
        Ok(msg) => {
            let p = path.clone();
            tokio::task::spawn_blocking(move || handler(&p, &msg))
                .await
                .unwrap_or_else(|e| Err(Status::new(13, format!("the call failed: {e}"))))
        }
        Err(s) => Err(s),
    };
    let head = |end| {
        let mut r = Response::builder()
            .status(200)
            .header("content-type", "application/grpc");
        if let Some((code, message)) = end {
            for (k, v) in &status_headers(code, message) {
                r = r.header(k, v);
            }
        }
        r.body(()).expect("static response head")
    };
    match reply {
        Err(s) => {
            // Trailers-only: the status in the one header block.
            let _ = respond.send_response(head(Some((s.code, &s.message))), true);
        }
        Ok(Reply::Unary(msg)) => {
            if let Ok(mut send) = respond.send_response(head(None), false) {
                let _ = send.send_data(frame(&msg), false);
                let _ = send.send_trailers(status_headers(0, ""));
            }
        }
        Ok(Reply::Hold(msg, until)) => {
            if let Ok(mut send) = respond.send_response(head(None), false) {
                if send.send_data(frame(&msg), false).is_ok() {
                    // Until the plugin stops, or the kubelet drops the stream.
                    let dropped = std::future::poll_fn(|cx| send.poll_reset(cx));
                    tokio::select! {
                        _ = until => {}
                        _ = dropped => return,
                    }
                    let _ = send.send_trailers(status_headers(0, ""));
                }
            }
        }
    }
}

/// How long a call may take (the kubelet answers in milliseconds).
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Calls `path` on the gRPC server at `socket` with `msg`; the answer's message. Gives up
/// after [`CALL_TIMEOUT`] (status 4, deadline exceeded).
pub async fn unary(socket: &Path, path: &str, msg: &[u8]) -> Result<Vec<u8>, Status> {
    match tokio::time::timeout(CALL_TIMEOUT, unary_now(socket, path, msg)).await {
        Ok(r) => r,
        Err(_) => Err(Status::new(
            4,
            format!(
                "{path} on {}: no answer within {CALL_TIMEOUT:?}",
                socket.display()
            ),
        )),
    }
}

async fn unary_now(socket: &Path, path: &str, msg: &[u8]) -> Result<Vec<u8>, Status> {
    let unavailable = |what: &str, e: &dyn std::fmt::Display| {
        Status::new(14, format!("{what} {}: {e}", socket.display()))
    };
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|e| unavailable("connecting to", &e))?;
    let (client, conn) = h2::client::handshake(stream)
        .await
        .map_err(|e| unavailable("HTTP/2 with", &e))?;
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let result = async {
        let mut client = client
            .ready()
            .await
            .map_err(|e| unavailable("HTTP/2 with", &e))?;
        let req = Request::builder()
            .method("POST")
            .uri(format!("http://localhost{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .map_err(|e| Status::new(13, e.to_string()))?;
        let (resp, mut send) = client
            .send_request(req, false)
            .map_err(|e| unavailable("calling", &e))?;
        send.send_data(frame(msg), true)
            .map_err(|e| unavailable("calling", &e))?;
        let resp = resp.await.map_err(|e| unavailable("calling", &e))?;
        let check = |h: &HeaderMap| -> Result<bool, Status> {
            let Some(code) = h.get("grpc-status") else {
                return Ok(false);
            };
            let code: u32 = code.to_str().ok().and_then(|c| c.parse().ok()).unwrap_or(2);
            if code == 0 {
                return Ok(true);
            }
            let message = h
                .get("grpc-message")
                .and_then(|m| m.to_str().ok())
                .unwrap_or_default();
            Err(Status::new(code, message))
        };
        if resp.status() != 200 {
            return Err(Status::new(14, format!("HTTP status {}", resp.status())));
        }
        if check(resp.headers())? {
            return Ok(Vec::new());
        }
        let mut body = resp.into_body();
        let msg = one_message(&mut body).await?;
        match body.trailers().await {
            Ok(Some(t)) => {
                check(&t)?;
            }
            Ok(None) => return Err(Status::new(13, "no grpc-status trailer")),
            Err(e) => return Err(unavailable("reading from", &e)),
        }
        Ok(msg)
    }
    .await;
    driver.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_unary_call_and_its_errors_go_both_ways() {
        let dir = crate::testutil::TmpDir::new("coloc-grpc");
        std::fs::create_dir_all(&*dir).unwrap();
        let sock = dir.join("s.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let handler: Handler = Arc::new(|path: &str, msg: &[u8]| match path {
            "/t.S/Echo" => Ok(Reply::Unary(msg.iter().rev().copied().collect())),
            "/t.S/Empty" => Ok(Reply::Unary(Vec::new())),
            _ => Err(Status::new(12, format!("unknown method {path}"))),
        });
        let server = tokio::spawn(serve(listener, handler));
        assert_eq!(unary(&sock, "/t.S/Echo", b"abc").await.unwrap(), b"cba");
        assert_eq!(unary(&sock, "/t.S/Empty", b"").await.unwrap(), b"");
        let big = vec![7u8; 200_000];
        assert_eq!(
            unary(&sock, "/t.S/Echo", &big).await.unwrap().len(),
            big.len()
        );
        let err = unary(&sock, "/t.S/Nope", b"").await.unwrap_err();
        assert_eq!(err.code, 12);
        assert!(err.message.contains("/t.S/Nope"), "{err}");
        server.abort();
        let err = unary(&dir.join("none.sock"), "/t.S/Echo", b"")
            .await
            .unwrap_err();
        assert_eq!(err.code, 14);
        assert!(err.message.contains("none.sock"), "{err}");
    }

    #[test]
    fn frames_that_lie_about_their_length_are_refused() {
        assert_eq!(unframe(&[0, 0, 0, 0, 2, 1, 2]).unwrap(), vec![1, 2]);
        assert!(unframe(&[0, 0, 0, 0, 3, 1, 2]).is_err());
        assert!(unframe(&[1, 0, 0, 0, 0]).is_err());
        assert!(unframe(&[0, 0]).is_err());
    }
}
