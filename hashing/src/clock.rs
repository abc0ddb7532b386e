//! The clock expiry times are kept in: absolute Unix time in milliseconds, the wall clock of
//! whichever host reads it.
//!
//! An item's expiry lives in its KV block as such a time, so every computenode and every
//! client library reading the block agrees on *when* it expires; each judges *whether* it
//! has by its own clock. Hosts are expected to keep their clocks in sync with NTP (on a LAN
//! they typically agree within a few milliseconds). A reader whose clock is `s` ms ahead of
//! the writer's sees a key expire `s` ms early, one behind sees it `s` ms late: a key lives
//! up to the skew longer or shorter than asked, never otherwise wrong.
//!
//! The memnode's active expiry ([`crate::expiry`]) removes an item only once its expiry is
//! [`MAX_CLOCK_SKEW_MS`] past by the memnode's clock, so a memnode within that skew of the
//! computenodes never removes a key that a computenode still considers live. Beyond it,
//! keys go early by the excess.
//!
//! The wall clock can step (an NTP correction, an administrator): a step forward expires
//! keys early, one back keeps them longer, by the step.

/// The clock skew between hosts racekv is built to tolerate (see the module doc): the
/// memnode's active expiry waits this long past an item's expiry before removing it.
pub const MAX_CLOCK_SKEW_MS: u64 = 100;

/// Now, as absolute Unix time in milliseconds: the one clock every part of racekv reads
/// (it lives in `racekv-telemetry`, which the Redis front end shares).
pub use racekv_telemetry::clock::now_unix_ms;
