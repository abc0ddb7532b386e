//! Lent shm connections (KRCORE's idea, on one host): a process holding the memnode's token
//! (the computenode daemon) dials the region server, authenticates, opens the RPC lanes,
//! and passes the descriptors to another local process (an attached client) over a Unix
//! socket. The borrower maps the region and uses the lanes as if it had connected itself,
//! without ever learning the token. A lent connection cannot open lanes of its own: once
//! they fail, its RPCs fail, and the borrower goes back to its daemon.
//!
//! ```text
//! lent : endpoint (u16 len + UTF-8) | region_len u64 | instance u64 | hello flags u32 |
//!        sender u64 | lanes u16 | per lane: key u32 | credits u32 | batch u32 | ring_bytes u64
//! descriptors, in order: control socket, region, then per lane: socket, rings
//! ```

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use parking_lot::Mutex;

use crate::decode::{DecodeError, Reader};
use crate::error::TransportError;
use crate::flock::shm::{dial_shm_lane, lane_setup};
use crate::flock::{Channel, FlockOptions};
use crate::shm::ShmConnection;
use crate::wire::{FlockAccept, HelloOk, HELLO_FLAG_REGION_FD};
use crate::ConnectOptions;

/// Most RPC lanes one lent connection carries (its descriptors: 2 + 2 per lane).
pub const MAX_LENT_LANES: usize = 4;
/// Longest endpoint label a lent connection carries.
pub const MAX_LENT_ENDPOINT_BYTES: usize = 512;
/// Most bytes [`LentShm::encode`] writes.
pub const MAX_LENT_BYTES: usize = 2 + MAX_LENT_ENDPOINT_BYTES + 8 + 8 + 4 + 8 + 2 + MAX_LENT_LANES * 20;

/// What the decoder's errors say they are.
const WHAT: &str = "malformed lent connection";

/// One RPC lane's descriptors and what the server granted it.
struct LentLane {
    socket: OwnedFd,
    rings: OwnedFd,
    accept: FlockAccept,
}

/// An authenticated shm connection, as descriptors that can cross a Unix socket.
pub struct LentShm {
    endpoint: String,
    hello: HelloOk,
    sender: u64,
    control: OwnedFd,
    region: OwnedFd,
    lanes: Vec<LentLane>,
}

impl std::fmt::Debug for LentShm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentShm").field("endpoint", &self.endpoint).field("lanes", &self.lanes.len()).finish()
    }
}

impl LentShm {
    /// Dials the region server at `path` with `options` (the lender's token) and opens
    /// `lanes` RPC lanes (1 to [`MAX_LENT_LANES`]).
    pub fn dial(path: &Path, options: &ConnectOptions, lanes: usize) -> Result<Self, TransportError> {
        assert!((1..=MAX_LENT_LANES).contains(&lanes), "1 to {MAX_LENT_LANES} lanes");
        let endpoint = format!("shm:{}", path.display());
        if endpoint.len() > MAX_LENT_ENDPOINT_BYTES {
            return Err(TransportError::Connect { endpoint, reason: "a socket path too long to lend".into() });
        }
        let (control, region, hello) = ShmConnection::dial(path, options)?;
        let sender = crate::net::random_u64();
        let mut lent = Vec::with_capacity(lanes);
        for lane in 0..lanes {
            let (socket, rings, accept) = dial_shm_lane(path, options, sender, lane as u16)?;
            lent.push(LentLane { socket: socket.into(), rings: rings.into(), accept });
        }
        Ok(Self { endpoint, hello, sender, control: control.into(), region: region.into(), lanes: lent })
    }

    /// Its endpoint (`shm:/path`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// How many descriptors a lent connection with `lanes` lanes carries.
    pub fn descriptors_for(lanes: usize) -> usize {
        2 + 2 * lanes
    }

    /// Appends its description (the format in the module's comment).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.endpoint.len() as u16).to_le_bytes());
        out.extend_from_slice(self.endpoint.as_bytes());
        out.extend_from_slice(&self.hello.region_len.to_le_bytes());
        out.extend_from_slice(&self.hello.instance.to_le_bytes());
        out.extend_from_slice(&self.hello.flags.to_le_bytes());
        out.extend_from_slice(&self.sender.to_le_bytes());
        out.extend_from_slice(&(self.lanes.len() as u16).to_le_bytes());
        for lane in &self.lanes {
            out.extend_from_slice(&lane.accept.key.to_le_bytes());
            out.extend_from_slice(&lane.accept.credits.to_le_bytes());
            out.extend_from_slice(&lane.accept.batch.to_le_bytes());
            out.extend_from_slice(&lane.accept.ring_bytes.to_le_bytes());
        }
    }

    /// Its descriptors, in the order [`Self::decode`] takes them.
    pub fn descriptors(&self) -> Vec<BorrowedFd<'_>> {
        let mut fds = vec![self.control.as_fd(), self.region.as_fd()];
        for lane in &self.lanes {
            fds.push(lane.socket.as_fd());
            fds.push(lane.rings.as_fd());
        }
        fds
    }

    /// Reads a description from `r` and takes its descriptors from `fds` (fails when too
    /// few arrived). Every length is checked against the limits before anything is taken.
    pub fn decode(r: &mut Reader<'_>, fds: &mut impl Iterator<Item = OwnedFd>) -> Result<Self, DecodeError> {
        let bad = |m: String| DecodeError::new(WHAT, m);
        let len = usize::from(r.u16()?);
        if len > MAX_LENT_ENDPOINT_BYTES {
            return Err(bad(format!("an endpoint of {len} bytes (at most {MAX_LENT_ENDPOINT_BYTES})")));
        }
        let endpoint = std::str::from_utf8(r.take(len)?).map_err(|_| bad("an endpoint that is not UTF-8".into()))?;
        if !endpoint.starts_with("shm:") {
            return Err(bad(format!("lent endpoint {endpoint:?} is not shm")));
        }
        let hello = HelloOk { region_len: r.u64()?, instance: r.u64()?, flags: r.u32()? };
        if hello.flags & HELLO_FLAG_REGION_FD == 0 {
            return Err(bad("a lent connection without its region".into()));
        }
        let sender = r.u64()?;
        let lanes = usize::from(r.u16()?);
        if !(1..=MAX_LENT_LANES).contains(&lanes) {
            return Err(bad(format!("{lanes} lanes (1 to {MAX_LENT_LANES})")));
        }
        let mut accepts = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let (key, credits, batch, ring_bytes) = (r.u32()?, r.u32()?, r.u32()?, r.u64()?);
            accepts.push(FlockAccept { key, credits, batch, ring_bytes, verbs: None });
        }
        let mut fd = || fds.next().ok_or_else(|| bad("fewer descriptors than the connection needs".into()));
        let (control, region) = (fd()?, fd()?);
        let mut lent = Vec::with_capacity(lanes);
        for accept in accepts {
            lent.push(LentLane { socket: fd()?, rings: fd()?, accept });
        }
        Ok(Self { endpoint: endpoint.to_string(), hello, sender, control, region, lanes: lent })
    }

    /// The borrower's connection: maps the region, watches the control socket, and runs
    /// RPCs on the lent lanes (operations time out after `timeout`).
    pub fn into_connection(self, timeout: Duration) -> Result<ShmConnection, TransportError> {
        let mut setups = Vec::with_capacity(self.lanes.len());
        for lane in self.lanes {
            let socket = UnixStream::from(lane.socket);
            setups.push(lane_setup(socket, File::from(lane.rings), &lane.accept, timeout, &self.endpoint)?);
        }
        let lanes = setups.len();
        let (sender, endpoint) = (self.sender, self.endpoint.clone());
        let once = Mutex::new(Some(setups));
        let open = move |_sender, _lanes| {
            once.lock().take().ok_or_else(|| TransportError::ConnectionLost {
                reason: format!(
                    "the rpc lanes lent for {endpoint} (sender {sender:#x}) failed; a lent connection cannot open more"
                ),
                maybe_executed: false,
            })
        };
        let options = FlockOptions { lanes, ..FlockOptions::default() };
        let channel = Channel::new(options, timeout, self.endpoint.clone(), Box::new(open));
        ShmConnection::assemble(
            UnixStream::from(self.control),
            &File::from(self.region),
            self.hello,
            &self.endpoint,
            channel,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever bytes come, decoding never panics and never takes more descriptors than
    /// there are (here: none, so every well-formed description fails for want of them).
    #[test]
    fn garbage_never_panics() {
        use proptest::prelude::*;
        proptest!(|(bytes in proptest::collection::vec(any::<u8>(), 0..700))| {
            let mut r = Reader::new(WHAT, &bytes);
            prop_assert!(LentShm::decode(&mut r, &mut std::iter::empty()).is_err());
        });
    }
}
