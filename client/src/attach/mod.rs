//! The attach protocol: how a process on the computenode's host reaches the local daemon
//! through a shared-memory request ring. Both sides use this module: the client library's
//! attached backend (`Client::builder().attach(..)`, and the default of `connect()`) and
//! the daemon's `racekv_computenode::attach::AttachServer`.
//!
//! (Not to be confused with [`crate::ring`], the consistent-hash ring of memnodes.)
//!
//! # Handshake ([`handshake`])
//!
//! The client connects to the daemon's Unix socket and sends a fixed 32-byte [`Hello`]
//! (magic, version, token digest, pid). The daemon checks the peer's uid (SO_PEERCRED) and
//! the token, creates a shared area for this client (a memfd) and two eventfd doorbells, and
//! answers [`Accepted`] (geometry and limits) with the three descriptors attached
//! (SCM_RIGHTS), or a refusal with a reason. The socket then stays open, silent, as the
//! liveness signal both ways: the daemon detaches a client whose socket closes; the client
//! fails its calls once the daemon's end closes. Before closing an attachment itself (a
//! protocol error, shutdown) the daemon sends a goodbye frame with the reason.
//!
//! # Shared area ([`area`])
//!
//! ```text
//! 0     header page: magic, version, slots, slot_bytes, area_len (daemon writes once)
//! 128   sq_tail          client: submissions published        (each control word on its
//! 192   sq_head          daemon: submissions taken              own 64-byte line)
//! 256   daemon_sleeping  daemon: 1 while it waits on its doorbell
//! 320   cq_tail          daemon: completions published
//! 384   cq_head          client: completions consumed
//! 448   client_sleeping  client: 1 while a thread waits on its doorbell
//! 4096  submission ring: `slots` u64 entries (a slot index each)
//!       completion ring: `slots` u64 entries (a slot index each)
//!       slots: `slots` x `slot_bytes`: header {request id u64, length u64 (replies: status
//!       in the high half), submitted-at ns u64, reserved u64} + payload (an `op.rs` request,
//!       then the same slot's reply)
//! ```
//!
//! A slot belongs to one request from submission to completion, so its reply always has
//! room, in-flight requests are at most `slots`, and neither ring can overflow for a client
//! that follows the protocol. Flow: the client writes a request into a free slot, appends the
//! slot's index to the submission ring and advances `sq_tail`; the daemon takes it, runs it,
//! writes the reply into the same slot, appends the index to the completion ring and
//! advances `cq_tail`; the client reads the reply and frees the slot. A reply larger than a
//! slot is staged by the daemon and fetched in parts, and a request larger than a slot is
//! sent in parts (see [`crate::op`]); a daemon without staging answers
//! [`area::status::REPLY_TOO_LARGE`] with the size it needed (the client then splits
//! multi-key requests and retries).
//!
//! # Wake-up ([`doorbell`])
//!
//! Each side spins briefly on the other's tail, then sets its `*_sleeping` word, checks the
//! tail once more and blocks on its eventfd. A producer publishes its tail, then (after a
//! SeqCst fence pairing with the sleeper's) reads the peer's sleeping word and writes the
//! peer's eventfd only if it is set. A busy ring therefore costs no system calls, and an
//! idle one no CPU.
//!
//! # Untrusted input
//!
//! The daemon treats the whole area as hostile: a client can write anything anywhere at any
//! time. The daemon keeps its own copies of everything that matters (geometry, `sq_head`,
//! `cq_tail`, which slots are in flight) and never reads them back from the area. Each value
//! it reads (`sq_tail`, a ring entry, a slot's length, `cq_head`) is read once, checked
//! against those private copies, and an impossible one is a [`ProtocolError`] that detaches
//! that client. Payloads are copied out once (length first, bounded by the slot) and decoded
//! from the private copy, so a torn or rewritten request decodes as garbage or as some other
//! request of that client, never as a panic or an out-of-bounds access. Memory per client is
//! bounded by the geometry and by a budget on the worst-case size of replies in flight
//! ([`reply_bound`]). All access goes through [`racekv_transport::Region`]: bounds-checked,
//! word-atomic, no `unsafe` here.

pub mod area;
pub mod client_side;
pub mod daemon_side;
pub mod doorbell;
pub mod handshake;
pub mod lending;

pub use area::Geometry;
pub use client_side::{ClientRing, SlotReply};
pub use daemon_side::{Completer, DaemonRing, ProtocolError, Submission};
pub use doorbell::Doorbell;
pub use handshake::{Accepted, Frame, Hello};

use racekv_hashing::MAX_KV_BYTES;

use crate::op::Request;

/// The most bytes of an encoded error reply (op.rs caps messages at 4096 bytes).
const ERROR_REPLY_BOUND: u64 = 4 + 4096;
/// A nominal bound for a STATS reply (a few hundred bytes per memnode).
pub const STATS_REPLY_BOUND: u64 = 64 << 10;
/// The most one key's entry adds to a VALUE/VALUES reply: presence byte, length, value.
pub const VALUE_REPLY_BOUND: u64 = 1 + 4 + MAX_KV_BYTES as u64;

/// The most bytes `request`'s encoded reply can take (what a daemon budgets per request in
/// flight, so a client cannot make it hold unbounded replies).
pub fn reply_bound(request: &Request) -> u64 {
    let specific = match request {
        Request::Get(_) => 4 + VALUE_REPLY_BOUND,
        Request::MultiGet(keys) => 4 + keys.len() as u64 * VALUE_REPLY_BOUND,
        Request::Put { .. } | Request::Delete(_) | Request::CompareAndSwap { .. } => 5,
        Request::MultiPut(_) => 4,
        Request::Len | Request::DeleteAll => 12,
        Request::Stats => STATS_REPLY_BOUND,
        Request::RandomKey => 4 + VALUE_REPLY_BOUND,
        // Keys count their length plus 8 against max_bytes and take 4 + length; one key
        // longer than max_bytes still comes alone.
        Request::Scan { max_bytes, .. } => {
            let keys = u64::from((*max_bytes).min(crate::op::MAX_SCAN_REPLY_BYTES)).max(4 + MAX_KV_BYTES as u64);
            crate::op::SCAN_REPLY_HEADER_BYTES as u64 + keys
        }
        Request::Expire { .. } => 5,
        // Outcome, then the old value.
        Request::PutOpts { .. } => 5 + VALUE_REPLY_BOUND,
        // Presence, the value, the expiry.
        Request::GetItem(_) => 4 + VALUE_REPLY_BOUND + 9,
        // The version (word, expiry), then as GET_ITEM.
        Request::ReadVersioned(_) => 4 + 8 + 9 + VALUE_REPLY_BOUND + 9,
        Request::Commit { .. } => 5,
        // A part is acknowledged with a count; the last one's reply is its request's, which
        // the daemon budgets once the request is assembled.
        Request::Part { .. } => 12,
        Request::FetchPart { max_len, .. } => crate::op::PART_REPLY_OVERHEAD_BYTES as u64 + u64::from(*max_len),
    };
    specific.max(ERROR_REPLY_BOUND)
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the host, so a client's
/// submission time means something to the daemon (metrics only; it is untrusted).
pub fn monotonic_ns() -> u64 {
    use nix::time::{clock_gettime, ClockId};
    clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| (t.tv_sec() as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec() as u64))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
