//! Other processes attach: through the default socket (found via `XDG_RUNTIME_DIR`), and
//! one that is killed with requests in flight. The child is this test executable, running
//! the ignored `child_process` test.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use racekv_client::{Client, Mode};

use super::super::AttachOptions;
use super::{metric, wait_for, Harness};

const CHILD_ENV: &str = "RACEKV_ATTACH_TEST_CHILD";

#[test]
#[ignore = "the child side of the process tests; does nothing unless they start it"]
fn child_process() {
    let Ok(mode) = std::env::var(CHILD_ENV) else { return };
    // No memnodes, no socket: attach to the default socket.
    let client = Client::builder().timeout(Duration::from_secs(20)).connect().expect("attach to the default socket");
    assert_eq!(client.mode(), Mode::Attached);
    match mode.as_str() {
        "get-put" => {
            assert_eq!(client.get(b"from-parent").unwrap().as_deref(), Some(&b"hello child"[..]));
            client.put(b"from-child", format!("pid {}", std::process::id()).as_bytes()).unwrap();
            println!("CHILD-OK");
        }
        "busy" => {
            std::thread::scope(|s| {
                for t in 0..4 {
                    let client = client.clone();
                    s.spawn(move || {
                        for i in 0u64.. {
                            let _ = client.put(format!("busy-{t}-{}", i % 100).as_bytes(), &i.to_le_bytes());
                        }
                    });
                }
                println!("CHILD-BUSY");
            });
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// Starts this executable's `child_process` test with `XDG_RUNTIME_DIR` pointing at the
/// harness' directory; returns it and a channel of its stdout lines.
fn spawn_child(h: &Harness, mode: &str) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["attach::tests::process::child_process", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, mode)
        .env("XDG_RUNTIME_DIR", h._dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

fn expect_line(rx: &mpsc::Receiver<String>, wanted: &str) {
    loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) if line.contains(wanted) => return,
            Ok(_) => {}
            Err(e) => panic!("the child never said {wanted}: {e}"),
        }
    }
}

/// A harness listening on the default socket for `XDG_RUNTIME_DIR` = its directory.
fn default_socket_harness() -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("racekv").join("computenode.sock");
    Harness::at(socket, dir, 1024, 2, AttachOptions::default())
}

#[test]
fn another_process_attaches_through_the_default_socket() {
    let h = default_socket_harness();
    let c = h.client();
    c.put(b"from-parent", b"hello child").unwrap();
    let (mut child, lines) = spawn_child(&h, "get-put");
    expect_line(&lines, "CHILD-OK");
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
    assert_eq!(c.get(b"from-child").unwrap(), Some(format!("pid {}", child.id()).into_bytes()));
    h.wait_attached(1);
}

#[test]
fn a_client_process_killed_mid_flight_is_detached() {
    let h = default_socket_harness();
    let before = metric("racekv_attach_detaches_total{reason=\"closed\"}");
    let (mut child, lines) = spawn_child(&h, "busy");
    expect_line(&lines, "CHILD-BUSY");
    h.wait_attached(1);
    wait_for(Duration::from_secs(10), || metric("racekv_attach_requests_in_flight") > 0.0 || h.queue.depth() > 0);
    child.kill().unwrap();
    child.wait().unwrap();
    h.wait_attached(0);
    assert!(metric("racekv_attach_detaches_total{reason=\"closed\"}") > before);
    let c = h.client();
    c.put(b"after", b"kill").unwrap();
    assert_eq!(c.get(b"after").unwrap().as_deref(), Some(&b"kill"[..]));
}
