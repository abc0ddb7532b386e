//! The receiver's side of opening a lane: a connection that sent FlockOpen gets a lane from
//! the scheduler, is answered (FlockAccept) with the carrier its listener offers (the tcp
//! stream itself, shared-memory rings passed over the Unix socket, or a verbs queue pair
//! with registered rings) and is served by [`super::receiver`] until it closes.

use std::os::fd::AsFd;
use std::time::Duration;

use super::receiver::{serve_lane, LaneContext};
use super::scheduler::Scheduler;
use super::service::RpcService;
use super::shm::ServerRings;
use super::stream::StreamCarrier;
use crate::auth::Caller;
use crate::net::random_u64;
use crate::server_stream::{refuse, ServerStream};
use crate::stop::StopSignal;
use crate::wire::{self, error_code};

/// What a region server lends its lanes.
pub(crate) struct LaneHost<'a> {
    pub rpc: &'a dyn RpcService,
    pub scheduler: &'a Scheduler,
    pub stopping: &'a StopSignal,
    /// Longest stall of a peer mid-message before the lane is dropped.
    pub stall: Duration,
    /// The region's registration with the NIC, when the server has a `verbs:` endpoint.
    #[cfg(feature = "rdma")]
    pub verbs: Option<&'a crate::verbs::VerbsHost>,
}

/// Serves `stream`, whose peer (`caller`) sent `open`, as a FLOCK lane until it closes.
/// Returns the metric reason when it ends badly.
pub(crate) fn serve_lane_connection<S: ServerStream>(
    host: &LaneHost<'_>,
    stream: &mut S,
    open: &wire::FlockOpen,
    caller: &Caller,
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    let (lane, credits) = host.scheduler.open(open.sender);
    let cx = LaneContext {
        rpc: host.rpc,
        caller,
        scheduler: host.scheduler,
        lane,
        key: (random_u64() as u32) | 1,
        initial_credits: credits,
        stopping: host.stopping,
    };
    let result = accept_lane(host, stream, open, &cx, out);
    host.scheduler.close(lane);
    result
}

/// Answers FlockOpen with the carrier this listener offers and serves the lane.
fn accept_lane<S: ServerStream>(
    host: &LaneHost<'_>,
    stream: &mut S,
    open: &wire::FlockOpen,
    cx: &LaneContext<'_>,
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    let (key, credits) = (cx.key, cx.initial_credits);
    let batch = host.scheduler.options().credits;
    out.clear();
    match stream.listener() {
        "tcp" => {
            if open.verbs.is_some() {
                return refuse(stream, out, 0, error_code::MALFORMED, "a tcp lane has no queue pair", "malformed");
            }
            wire::encode_flock_accept(out, &wire::FlockAccept { key, credits, batch, ring_bytes: 0, verbs: None });
            stream.write_all(out).map_err(|_| "io")?;
            serve_lane(&mut StreamCarrier { stream, stall: host.stall }, cx)
        }
        "unix" => {
            if open.verbs.is_some() {
                return refuse(stream, out, 0, error_code::MALFORMED, "an shm lane has no queue pair", "malformed");
            }
            let (file, mut carrier) = match ServerRings::create() {
                Ok(parts) => parts,
                Err(e) => {
                    tracing::warn!("region server: cannot create flock rings: {e}");
                    return refuse(stream, out, 0, error_code::SETUP_FAILED, &e.to_string(), "io");
                }
            };
            carrier.keyed(key, host.stall);
            let ring_bytes = carrier.ring_bytes();
            wire::encode_flock_accept(out, &wire::FlockAccept { key, credits, batch, ring_bytes, verbs: None });
            stream.send_with_fd(out, file.as_fd()).map_err(|_| "io")?;
            drop(file);
            carrier.watch(stream.as_fd());
            serve_lane(&mut carrier, cx)
        }
        _ => accept_verbs_lane(host, stream, open, cx, batch, out),
    }
}

/// A verbs lane: the client's FlockOpen carries its queue pair and response ring; we make
/// ours (QP and request ring), connect, answer with their description and serve the lane
/// over RDMA, keeping this TCP connection only to notice the client leaving.
#[cfg(feature = "rdma")]
fn accept_verbs_lane<S: ServerStream>(
    host: &LaneHost<'_>,
    stream: &mut S,
    open: &wire::FlockOpen,
    cx: &LaneContext<'_>,
    batch: u32,
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    let Some(peer) = open.verbs else {
        return refuse(
            stream,
            out,
            0,
            error_code::MALFORMED,
            "a verbs lane needs the sender's queue pair and ring (FlockOpen without its verbs part)",
            "malformed",
        );
    };
    let Some(verbs) = host.verbs else {
        return refuse(stream, out, 0, error_code::UNSUPPORTED, "this endpoint does not serve verbs", "malformed");
    };
    let (mut carrier, mine) = match super::verbs::ServerLane::accept(verbs.device(), &peer, cx.key, host.stall) {
        Ok(parts) => parts,
        Err(message) => {
            tracing::warn!("region server: cannot set up a flock verbs lane: {message}");
            return refuse(stream, out, 0, error_code::SETUP_FAILED, &message, "verbs_setup");
        }
    };
    let accept = wire::FlockAccept {
        key: cx.key,
        credits: cx.initial_credits,
        batch,
        ring_bytes: mine.ring_len,
        verbs: Some(mine),
    };
    wire::encode_flock_accept(out, &accept);
    stream.write_all(out).map_err(|_| "io")?;
    carrier.watch(stream.as_fd());
    serve_lane(&mut carrier, cx)
}

#[cfg(not(feature = "rdma"))]
fn accept_verbs_lane<S: ServerStream>(
    _host: &LaneHost<'_>,
    stream: &mut S,
    _open: &wire::FlockOpen,
    _cx: &LaneContext<'_>,
    _batch: u32,
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    // No verbs listener exists in a build without RDMA support.
    refuse(stream, out, 0, error_code::UNSUPPORTED, "this build serves no verbs lanes", "malformed")
}
