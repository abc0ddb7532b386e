//! The RACE hash table (Zuo et al., USENIX ATC'21) over racekv's one-sided transports.
//!
//! * [`layout`]: where everything lives in a memnode's region and how words are encoded.
//! * [`table`]: the client protocols ([`Table`], [`TableClient`]): search, upsert, delete,
//!   compare-and-swap, each a few one-sided round trips.
//! * [`scan`]: the cursor of walks over a whole table (SCAN), and why a key present for the
//!   whole walk is returned however the table splits.
//! * [`split`]: the memnode-side split that grows the table, with its invariants.
//! * [`service`]: the memnode's RPC methods (metadata, chunk allocation, split, stats).
//! * [`directory`], [`alloc`], [`heap`], [`format`]: the directory cache, client-side block
//!   allocation with a grace period, the memnode's heap, and formatting a region.
//! * [`reclaim`]: at a memnode's start, every heap byte no slot references becomes free.
//! * [`access`]: cache mode's access metadata (LRU and LFU) in each block, updated by
//!   readers with one-sided CAS.
//! * [`clock`], [`expiry`]: the clock items' expiry times are kept in, and the memnode's
//!   active expiry (sampling slots, removing expired items nobody reads, freeing their
//!   blocks). Readers treat expired items as absent and remove those they meet.
//!
//! This crate opens no sockets and starts no threads: it runs on any
//! [`racekv_transport::Connection`].

// `unsafe` only in `epoch_cell` (opted in below), each block with the argument for its soundness.
#![deny(unsafe_code)]

pub mod access;
pub mod alloc;
pub mod clock;
pub mod directory;
#[allow(unsafe_code)] // crossbeam-epoch deref and deferred destruction
mod epoch_cell;
pub mod error;
pub mod expiry;
pub mod extents;
pub mod format;
pub mod hash;
pub mod heap;
pub mod layout;
mod probe;
pub mod reclaim;
pub mod rpc;
pub mod scan;
pub mod service;
pub mod split;
pub(crate) mod stall;
pub mod table;
#[cfg(feature = "testing")]
pub mod testing;
mod words;

pub use error::Error;
pub use layout::{Layout, MAX_KV_BYTES};
pub use scan::{ScanLimits, ScanPage, TableCursor};
pub use service::{TableService, TableStats};
pub use table::{
    ClientStats, Expiry, ExpiryUpdate, Item, PutMode, PutOptions, PutOutcome, PutResult, Table, TableClient,
    TableOptions, Witness,
};
