//! `python/vlm_test_server.py` as a test fixture (shared by lora-tagger's and the CLI's tests).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn python() -> String {
    std::env::var("LORA_SDK_PYTHON").unwrap_or_else(|_| ".venv/bin/python".into())
}

/// `python/vlm_test_server.py` on a free loopback port: an OpenAI-compatible server that
/// validates image requests against llama-cpp-python's own request model and vLLM's documented
/// shape, and describes the image it received. Stops when dropped (its stdin closes).
pub struct VlmTestServer {
    child: Child,
    pub port: u16,
    /// The server's request log (JSON lines: body without the image payload, verdict, reply).
    pub log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl VlmTestServer {
    pub fn start() -> Self {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/vlm_test_server.py");
        assert!(script.exists(), "{} is missing", script.display());
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("requests.jsonl");
        let mut child = Command::new(python())
            .arg(&script)
            .args(["--port", "0", "--log"])
            .arg(&log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {} with {}: {e}", script.display(), python()));
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| {
                panic!("vlm_test_server.py did not start (run `cargo xtask setup`): {line:?}")
            });
        VlmTestServer {
            child,
            port,
            log,
            _dir: dir,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// The logged requests, in arrival order.
    pub fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for VlmTestServer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
