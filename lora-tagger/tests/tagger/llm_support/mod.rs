//! Test support: a real HTTP/1.1 listener on loopback whose replies a test scripts, and a guard
//! that runs llama-cpp-python's OpenAI-compatible server.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One request as the listener read it.
#[derive(Debug, Clone)]
pub struct Request {
    /// Request line, e.g. `POST /v1/chat/completions HTTP/1.1`.
    pub line: String,
    /// Header lines, lowercased names.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: String,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The last user message's content of an OpenAI chat request.
    pub fn description(&self) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        v["messages"]
            .as_array()
            .and_then(|m| m.last())
            .and_then(|m| m["content"].as_str())
            .unwrap_or("")
            .to_string()
    }
}

/// What the listener does with a request.
pub enum Reply {
    /// Answer with this status, extra headers and body.
    Status(u16, Vec<(String, String)>, String),
    /// Close the connection without answering.
    Close,
    /// Keep the connection open without answering until the listener stops.
    Hang,
}

impl Reply {
    pub fn json(status: u16, body: String) -> Self {
        Reply::Status(
            status,
            vec![("Content-Type".into(), "application/json".into())],
            body,
        )
    }

    /// A 200 OpenAI chat completion whose message content is `content`.
    pub fn chat(content: &str) -> Self {
        let body = serde_json::json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
        });
        Reply::json(200, body.to_string())
    }
}

type Handler = dyn Fn(usize, &Request) -> Reply + Send + Sync;

/// A loopback HTTP server; each connection is answered on its own thread with
/// `Connection: close`. Counts connections, requests, and the most requests in flight at once.
pub struct Listener {
    pub port: u16,
    pub connections: Arc<AtomicUsize>,
    pub requests: Arc<Mutex<Vec<Request>>>,
    pub max_in_flight: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn read_request(stream: &mut TcpStream) -> Option<Request> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut r = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (n, v) = h.split_once(':')?;
        headers.push((n.trim().to_lowercase(), v.trim().to_string()));
    }
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).ok()?;
    Some(Request {
        line: line.trim_end().to_string(),
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

impl Listener {
    /// Starts listening on a free loopback port; `handler(n, request)` (n = 0-based request
    /// number) decides each reply; `delay` is waited before answering (to overlap requests).
    pub fn start(
        delay: Duration,
        handler: impl Fn(usize, &Request) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let max_in_flight = Arc::new(AtomicUsize::new(0));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let handler: Arc<Handler> = Arc::new(handler);
        let (c, rq, mx, st) = (
            connections.clone(),
            requests.clone(),
            max_in_flight.clone(),
            stop.clone(),
        );
        let thread = std::thread::spawn(move || {
            let mut workers = Vec::new();
            // bounded: stops when told, or after 120 s at the latest
            let deadline = Instant::now() + Duration::from_secs(120);
            while !st.load(Ordering::SeqCst) && Instant::now() < deadline {
                match listener.accept() {
                    Ok((mut stream, _)) => {
                        stream.set_nonblocking(false).unwrap();
                        c.fetch_add(1, Ordering::SeqCst);
                        let (h, rq, mx, inf, st) = (
                            handler.clone(),
                            rq.clone(),
                            mx.clone(),
                            in_flight.clone(),
                            st.clone(),
                        );
                        workers.push(std::thread::spawn(move || {
                            let Some(req) = read_request(&mut stream) else { return };
                            let n = {
                                let mut all = rq.lock().unwrap();
                                all.push(req.clone());
                                all.len() - 1
                            };
                            let now = inf.fetch_add(1, Ordering::SeqCst) + 1;
                            mx.fetch_max(now, Ordering::SeqCst);
                            std::thread::sleep(delay);
                            let reply = h(n, &req);
                            inf.fetch_sub(1, Ordering::SeqCst);
                            match reply {
                                Reply::Status(code, headers, body) => {
                                    let mut out = format!(
                                        "HTTP/1.1 {code} X\r\nContent-Length: {}\r\nConnection: close\r\n",
                                        body.len()
                                    );
                                    for (k, v) in headers {
                                        out.push_str(&format!("{k}: {v}\r\n"));
                                    }
                                    out.push_str("\r\n");
                                    out.push_str(&body);
                                    let _ = stream.write_all(out.as_bytes());
                                    let _ = stream.flush();
                                }
                                Reply::Close => {}
                                Reply::Hang => {
                                    let until = Instant::now() + Duration::from_secs(60);
                                    while !st.load(Ordering::SeqCst) && Instant::now() < until {
                                        std::thread::sleep(Duration::from_millis(20));
                                    }
                                }
                            }
                        }));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            for w in workers {
                let _ = w.join();
            }
        });
        Listener {
            port,
            connections,
            requests,
            max_in_flight,
            stop,
            thread: Some(thread),
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    pub fn request_count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A port that nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// The project's Python (`LORA_SDK_PYTHON`, set by `.cargo/config.toml`).
pub fn python() -> String {
    std::env::var("LORA_SDK_PYTHON").unwrap_or_else(|_| ".venv/bin/python".into())
}

/// The embedded SmolLM2 GGUF, as an absolute path.
pub fn smollm2_gguf() -> std::path::PathBuf {
    let assets = std::env::var("LORA_SDK_ASSETS").unwrap_or_else(|_| "assets".into());
    let p = std::path::PathBuf::from(assets).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `cargo xtask setup` to fetch the assets",
        p.display()
    );
    p
}

/// `python -m llama_cpp.server` with llama.cpp's extra weight buffer types off
/// (`llama_model_params.use_extra_bufts = false`): a llama.cpp built with `-march=native` on a CPU
/// with AMX puts Q4_1 weights in its AMX buffer type, and the first decode then segfaults on this
/// machine kind (seen with llama-cpp-python 0.3.36). `cargo xtask setup` builds it without AMX;
/// this keeps the test working with a llama-cpp-python built some other way.
const SERVER_MAIN: &str = "import runpy, sys
import llama_cpp.llama as L
_default = L.llama_cpp.llama_model_default_params
def _params():
    p = _default()
    p.use_extra_bufts = False
    return p
L.llama_cpp.llama_model_default_params = _params
sys.argv[0] = 'llama_cpp.server'
runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)
";

/// llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, see
/// [`SERVER_MAIN`]) on a free loopback port, killed on drop.
pub struct LlamaServer {
    child: Child,
    pub port: u16,
    log: std::path::PathBuf,
}

impl LlamaServer {
    /// The served model name (`--model_alias`).
    pub const MODEL: &'static str = "smollm2";

    /// Starts the server on SmolLM2 and waits (at most 120 s) until `GET /v1/models` answers.
    /// Panics with a clear message when llama-cpp-python is not installed in the venv.
    pub fn start() -> Self {
        let py = python();
        let check = Command::new(&py)
            .args([
                "-c",
                "import llama_cpp.server, llama_cpp; print(llama_cpp.__version__)",
            ])
            .output();
        match &check {
            Ok(o) if o.status.success() => {}
            _ => panic!(
                "llama-cpp-python[server] is not installed in {py}: run `cargo xtask setup` \
                 (it builds llama.cpp; pinned in python/requirements.txt). Details: {:?}",
                check.map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            ),
        }
        let model = smollm2_gguf();
        let port = closed_port();
        let log = std::env::temp_dir().join(format!("llama_server_{port}.log"));
        let log_file = std::fs::File::create(&log).unwrap();
        let child = Command::new(&py)
            .args(["-c", SERVER_MAIN, "--model"])
            .arg(&model)
            .args([
                "--model_alias",
                Self::MODEL,
                "--host",
                "127.0.0.1",
                "--port",
            ])
            .arg(port.to_string())
            .args(["--n_ctx", "2048", "--n_threads", "2", "--verbose", "false"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .spawn()
            .unwrap();
        let mut server = LlamaServer { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!(
                    "llama_cpp.server exited with {status}: {}",
                    std::fs::read_to_string(&server.log).unwrap_or_default()
                );
            }
            let ok = ureq::get(&format!("http://127.0.0.1:{port}/v1/models"))
                .call()
                .map(|r| r.status().as_u16() == 200)
                .unwrap_or(false);
            if ok {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "llama_cpp.server did not answer within 120 s: {}",
                std::fs::read_to_string(&server.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}
