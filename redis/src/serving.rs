//! What serving a connection takes, whatever the I/O model (a thread per connection in
//! [`super::server`], or [`super::event_loop`]): the state every connection shares, a
//! client and a parser per connection, executing the commands a read completed, and
//! releasing a connection that closed.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use racekv_telemetry::ratelimit::{limited_warn, RateLimit};
use racekv_transport::stop::StopSignal;

use super::commands::Client;
use super::info::ServerStats;
use super::metrics::METRICS;
use super::options::ServerOptions;
use super::reply::{Output, Reply};
use super::resp::{Command, Parser, ProtocolError};
use super::store::KvStore;

/// Bytes read from a socket at a time; also the most the parser buffers beyond one command.
pub const READ_CHUNK_BYTES: usize = 16 << 10;

/// Replies gathered beyond this are written before executing the next command of the same
/// read, so a read full of large `MGET`s cannot pile up unbounded output.
pub const MAX_PENDING_REPLY_BYTES: usize = 1 << 20;

/// After an error reply, how long and how much we keep reading (and discarding) before
/// closing: closing a socket with unread input sends a TCP reset, which can destroy the
/// error reply before the client reads it.
pub(super) const LINGER: Duration = Duration::from_millis(200);
pub(super) const LINGER_MAX_BYTES: usize = 4 << 20;

/// The state every connection of a server shares.
pub(super) struct Serving {
    pub(super) store: Arc<dyn KvStore>,
    pub(super) options: ServerOptions,
    pub(super) stats: Arc<ServerStats>,
    /// Set at shutdown; wakes the acceptor, which waits on it with no timeout.
    pub(super) stopping: StopSignal,
    /// A handle on every open connection served by a thread of its own, so shutdown can
    /// unblock its thread.
    pub(super) open: Mutex<HashMap<u64, TcpStream>>,
}

static CROSS_PROTOCOL_LOG: RateLimit = RateLimit::per_minute();
static BUDGET_LOG: RateLimit = RateLimit::per_minute();

/// Forgets connection `id`, which closed for `reason` (a metric label).
pub(super) fn release(shared: &Serving, id: u64, reason: &'static str) {
    shared.open.lock().remove(&id);
    shared.stats.client_gone();
    METRICS.connected_clients.dec();
    METRICS.connections_closed.with_label_values(&[reason]).inc();
}

/// A [`Client`] over the server's store (its storage session comes with its first command
/// that needs one), registered with where it connects from.
pub(super) fn new_client(
    shared: &Serving,
    id: u64,
    addr: Option<SocketAddr>,
    laddr: Option<SocketAddr>,
    fd: i64,
) -> Client {
    let client = Client::new(id, Arc::clone(&shared.store), Arc::clone(&shared.stats), Arc::clone(&shared.options.acl));
    client.set_connection(addr, laddr, fd);
    client
}

/// A connection's parser: the server's limits, charging the server's query buffer budget.
pub(super) fn new_parser(shared: &Serving) -> Parser {
    let mut limits = shared.options.limits;
    limits.max_command_bytes = shared.stats.settings.client_query_buffer_limit();
    Parser::with_budget(limits, Arc::clone(shared.stats.settings.query_budget()))
}

/// Feeds what a connection read to its parser, under the current `client-query-buffer-limit`.
pub(super) fn feed(shared: &Serving, parser: &mut Parser, bytes: &[u8]) {
    let limit = shared.stats.settings.client_query_buffer_limit();
    if parser.limits().max_command_bytes != limit {
        parser.set_max_command_bytes(limit);
    }
    parser.feed(bytes);
}

/// What [`run_commands`] stopped for.
pub(super) enum Step {
    /// Every complete command buffered was executed.
    NeedInput,
    /// The gathered replies reached [`MAX_PENDING_REPLY_BYTES`]: write them, then call again
    /// (nothing more executes until they are down to less).
    Flush,
    /// `CLIENT PAUSE` holds the next command (kept by the client) until at most this
    /// instant: write the replies so far, then call again (after the pause, or to look again).
    Paused(Instant),
    /// The connection ends once the replies are written (the metric label says why).
    End(&'static str),
}

/// Executes the complete commands `parser` holds, appending their replies to `out`, and
/// publishes their figures before the replies go out.
pub(super) fn run_commands(shared: &Serving, client: &mut Client, parser: &mut Parser, out: &mut Output) -> Step {
    let step = run_parsed(shared, client, parser, out);
    client.publish_tally();
    step
}

fn run_parsed(shared: &Serving, client: &mut Client, parser: &mut Parser, out: &mut Output) -> Step {
    // Consecutive GETs wait in the client's run and execute together, before anything that
    // follows them. Executed commands go back to the parser for reuse.
    // When the last command executed on its own ended: the next one's start, if nothing
    // else ran between (its parsing is then counted in its time).
    let mut chained: Option<Instant> = None;
    let step = loop {
        // Checked first: a slow reader's pending replies (an event loop's connection) stop
        // the execution of more commands until they are written.
        if out.len() >= MAX_PENDING_REPLY_BYTES {
            break Step::Flush;
        }
        if client.killed() {
            run_gets(client, parser, out);
            return Step::End("killed");
        }
        let (cmd, held_before) = match client.take_postponed() {
            Some(cmd) => (cmd, true),
            None => match parser.next_command() {
                Ok(Some(cmd)) => (cmd, false),
                Ok(None) => break Step::NeedInput,
                Err(e) => {
                    run_gets(client, parser, out);
                    out.push(Reply::Error(e.reply_text().into()), client.protocol());
                    if let ProtocolError::QueryBufferBudget { limit } = e {
                        METRICS.query_buffer_refusals.inc();
                        limited_warn(&BUDGET_LOG, || {
                            format!(
                                "redis client {}: closed, its command would take the query buffer budget \
                                 ({limit} bytes, query-buffer-budget) past its limit",
                                client.id()
                            )
                        });
                        return Step::End("query_buffer_budget");
                    }
                    METRICS.protocol_errors.with_label_values(&[e.reason()]).inc();
                    shared.stats.protocol_error();
                    tracing::debug!("redis client {}: protocol error: {e}", client.id());
                    return Step::End("protocol_error");
                }
            },
        };
        if is_cross_protocol(&cmd) {
            // An HTTP request (a browser made to POST to this port): close without executing
            // anything after it, as Redis does.
            run_gets(client, parser, out);
            METRICS.cross_protocol.inc();
            limited_warn(&CROSS_PROTOCOL_LOG, || {
                format!(
                    "redis client {}: POST or Host: sent as a command, probably a cross-protocol attack \
                     (an HTTP request to the Redis port); connection closed",
                    client.id()
                )
            });
            return Step::End("cross_protocol");
        }
        if let Some(until) = client.pause_holds(&cmd) {
            run_gets(client, parser, out);
            if !held_before {
                METRICS.paused_commands.inc();
            }
            client.postpone(cmd, !held_before);
            return Step::Paused(until);
        }
        if held_before {
            client.resume();
        }
        if client.may_batch_get(&cmd) {
            chained = None;
            if client.queue_get(cmd) < MAX_GET_RUN {
                continue;
            }
            run_gets(client, parser, out);
        } else {
            // Queued GETs, if any, ran after `chained` was cleared when the first was queued.
            run_gets(client, parser, out);
            let started = chained.take().unwrap_or_else(Instant::now);
            let (reply, ended) = client.execute_from(&cmd, started);
            chained = Some(ended);
            out.push(reply, client.protocol());
            parser.recycle(cmd);
            if client.wants_close() {
                return Step::End(if client.killed() { "killed" } else { "client_quit" });
            }
        }
    };
    run_gets(client, parser, out);
    step
}

/// `POST` or `Host:` as a command: an HTTP request sent to the Redis port. No Redis command
/// has these names; a browser can be made to send them (cross-protocol scripting).
fn is_cross_protocol(cmd: &Command) -> bool {
    cmd.get(0).is_some_and(|name| name.eq_ignore_ascii_case(b"post") || name.eq_ignore_ascii_case(b"host:"))
}

fn run_gets(client: &mut Client, parser: &mut Parser, out: &mut Output) {
    client.run_queued_gets(out, |cmd| parser.recycle(cmd));
}

/// Most pipelined GETs looked up together (see [`Client::execute_gets`]).
const MAX_GET_RUN: usize = 32;
