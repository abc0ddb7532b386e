//! One thread's GET round trip: embedded on shm versus attached (through the ring, the work
//! queue and a worker). Prints numbers; asserts nothing about them. Run with
//! `cargo test -p racekv-computenode --release attach::tests::latency -- --ignored --nocapture`.

use std::time::{Duration, Instant};

use racekv_client::Client;

use super::super::AttachOptions;
use super::{Harness, Workers};

const WARMUP: usize = 5_000;
const SAMPLES: usize = 50_000;

fn measure(label: &str, client: &Client) {
    let key = b"latency-key";
    client.put(key, &[7u8; 100]).unwrap();
    for _ in 0..WARMUP {
        client.get(key).unwrap().unwrap();
    }
    let mut ns: Vec<u64> = Vec::with_capacity(SAMPLES);
    let started = Instant::now();
    for _ in 0..SAMPLES {
        let t = Instant::now();
        let v = client.get(key).unwrap();
        ns.push(t.elapsed().as_nanos() as u64);
        assert_eq!(v.map(|v| v.len()), Some(100));
    }
    let total = started.elapsed();
    ns.sort_unstable();
    let pct = |p: f64| ns[((ns.len() as f64 * p) as usize).min(ns.len() - 1)] as f64 / 1000.0;
    println!(
        "{label:<64} mean {:>7.2} us  p50 {:>7.2}  p90 {:>7.2}  p99 {:>7.2}  p99.9 {:>8.2}",
        total.as_secs_f64() * 1e6 / SAMPLES as f64,
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(0.999)
    );
}

#[test]
#[ignore = "a measurement: run it in release mode with --nocapture"]
fn attached_versus_embedded_get_latency() {
    println!("one thread, GET of a 100-byte value, {SAMPLES} samples, {:?} CPUs", std::thread::available_parallelism());
    for daemon_spin in [Duration::from_micros(20), Duration::ZERO] {
        let mut h = Harness::with(1024, 0, AttachOptions { spin: daemon_spin, ..AttachOptions::default() });
        if daemon_spin > Duration::ZERO {
            measure("embedded (shm)", &h.embedded());
        }
        for polling in [false, true] {
            h.workers = None;
            h.workers = Some(Workers::start(&h.queue, &h.memnode, 1, polling));
            for client_spin in [Duration::from_micros(50), Duration::ZERO] {
                let client = Client::builder().attach(&h.socket).attach_spin(client_spin).connect().unwrap();
                let label = format!(
                    "attached: worker {}, client spin {client_spin:?}, daemon spin {daemon_spin:?}",
                    if polling { "polls" } else { "parks" }
                );
                measure(&label, &client);
            }
        }
    }
}
