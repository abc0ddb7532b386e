//! Fuzzes the metrics endpoint's HTTP/1 request handling with untrusted connection bytes.
//!
//! The input is everything a peer sends on one connection, then EOF; it goes through the
//! real server connection (hyper with the endpoint's default limits, its router and its
//! refusals) over an in-memory pipe. Checked, beyond "no panic, no hang, no huge
//! allocation": the server's output is empty or starts with a status line, and is bounded
//! by the number of requests the input can hold times the largest answer (a rendered
//! metrics page plus headers).
#![no_main]

use libfuzzer_sys::fuzz_target;

/// The shortest request hyper accepts is `GET / HTTP/1.0\n\n` (16 bytes); half that leaves
/// room for whatever hyper tolerates at the edges.
const MIN_REQUEST_BYTES: usize = 8;
/// Status line, headers, and an error page, generously.
const MAX_ANSWER_OVERHEAD_BYTES: usize = 1024;

fuzz_target!(|data: &[u8]| {
    let output = racekv_telemetry::serve_bytes_for_fuzzing(data);
    assert!(output.is_empty() || output.starts_with(b"HTTP/1."), "{:?}", String::from_utf8_lossy(&output));
    // Rendered after serving: the metrics only grow, so this bounds every earlier answer.
    let largest_answer = racekv_telemetry::render().len() + MAX_ANSWER_OVERHEAD_BYTES;
    let most_answers = data.len() / MIN_REQUEST_BYTES + 1;
    assert!(output.len() <= most_answers * largest_answer, "{} bytes out for {} in", output.len(), data.len());
});
