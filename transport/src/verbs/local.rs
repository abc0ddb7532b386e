//! This process's RDMA device: one context, one protection domain and one chosen port/GID,
//! shared by every verbs connection and region server in the process (opening a device and
//! allocating a PD per connection would cost milliseconds each and buy nothing).
//!
//! Choice, overridable through the environment:
//! * `RACEKV_RDMA_DEVICE`: device name (default: the first device with an ACTIVE port);
//! * `RACEKV_RDMA_PORT`: port number (default: the device's first ACTIVE port);
//! * `RACEKV_RDMA_GID_INDEX`: GID table index (default: prefer an IPv4-mapped RoCE v2 GID,
//!   else the first non-zero GID; InfiniBand ports route by LID and use GID 0).

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::device::{is_ipv4_mapped, Context, LINK_LAYER_ETHERNET};
use super::error::VerbsError;
use super::memory::ProtectionDomain;

/// The port and address this process uses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PortChoice {
    pub port: u8,
    pub gid_index: u8,
    pub gid: [u8; 16],
    pub lid: u16,
    /// `ibv_mtu` code of the port's active MTU.
    pub mtu: u32,
    /// RoCE (Ethernet link layer): addressing is by GID, so every path needs a GRH.
    pub roce: bool,
}

pub(crate) struct LocalDevice {
    pub pd: Arc<ProtectionDomain>,
    pub port: PortChoice,
}

impl LocalDevice {
    pub fn ctx(&self) -> &Arc<Context> {
        self.pd.context()
    }

    pub fn name(&self) -> &str {
        self.ctx().name()
    }
}

static SHARED: Mutex<Weak<LocalDevice>> = Mutex::new(Weak::new());

/// The process's device, opened on first use and closed when the last user drops it.
pub(crate) fn shared() -> Result<Arc<LocalDevice>, VerbsError> {
    let mut slot = SHARED.lock();
    if let Some(device) = slot.upgrade() {
        return Ok(device);
    }
    let device = Arc::new(open()?);
    *slot = Arc::downgrade(&device);
    Ok(device)
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

fn env_number<T: std::str::FromStr>(name: &str) -> Result<Option<T>, VerbsError> {
    match env(name) {
        None => Ok(None),
        Some(text) => text
            .parse()
            .map(Some)
            .map_err(|_| VerbsError::Unsupported(format!("{name}={text:?} is not a valid number"))),
    }
}

fn open() -> Result<LocalDevice, VerbsError> {
    let ctx = Arc::new(Context::open(env("RACEKV_RDMA_DEVICE").as_deref())?);
    let port = match env_number::<u8>("RACEKV_RDMA_PORT")? {
        Some(port) => port,
        None => ctx.first_active_port().ok_or_else(|| VerbsError::NoActivePort {
            device: ctx.name().to_string(),
            detail: format!("none of its {} port(s) is ACTIVE", ctx.caps().ports),
        })?,
    };
    let attr = ctx.port(port)?;
    if !attr.is_active() {
        return Err(VerbsError::NoActivePort {
            device: ctx.name().to_string(),
            detail: format!("port {port} is not ACTIVE"),
        });
    }
    let roce = attr.link_layer == LINK_LAYER_ETHERNET;
    let gid_index = match env_number::<u32>("RACEKV_RDMA_GID_INDEX")? {
        Some(index) => index,
        None if roce => pick_gid(&ctx, port, attr.gid_tbl_len)?,
        None => 0,
    };
    let gid = ctx.gid(port, gid_index)?;
    if roce && gid == [0; 16] {
        return Err(VerbsError::Unsupported(format!(
            "{} port {port} GID {gid_index} is empty: give the interface under it an IP address, or set RACEKV_RDMA_GID_INDEX",
            ctx.name()
        )));
    }
    let gid_index =
        u8::try_from(gid_index).map_err(|_| VerbsError::Unsupported(format!("GID index {gid_index} exceeds 255")))?;
    let pd = ProtectionDomain::new(ctx)?;
    let choice = PortChoice { port, gid_index, gid, lid: attr.lid, mtu: attr.active_mtu, roce };
    tracing::info!(device = pd.context().name(), port, gid_index, "verbs: using RDMA device");
    Ok(LocalDevice { pd, port: choice })
}

/// The best GID for RoCE: IPv4-mapped (routable RoCE v2 on any IPv4 network) first, then
/// RoCE v2, then any non-zero entry; the lowest index among equals.
fn pick_gid(ctx: &Context, port: u8, table_len: u32) -> Result<u32, VerbsError> {
    let mut best: Option<(u8, u32)> = None;
    for index in 0..table_len {
        let Ok(gid) = ctx.gid(port, index) else {
            continue;
        };
        if gid == [0; 16] {
            continue;
        }
        let v2 = ctx.gid_type(port, index).is_some_and(|t| t.contains("v2"));
        let score = u8::from(is_ipv4_mapped(&gid)) * 2 + u8::from(v2);
        let better = match best {
            Some((best_score, _)) => score > best_score,
            None => true,
        };
        if better {
            best = Some((score, index));
        }
    }
    best.map(|(_, index)| index).ok_or_else(|| {
        VerbsError::Unsupported(format!(
            "{} port {port} has no GID: give its network interface an IP address (RoCE addresses are IP addresses)",
            ctx.name()
        ))
    })
}
