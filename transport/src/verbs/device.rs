//! Devices, device contexts, ports and GIDs: the bottom layer over libibverbs.
//!
//! Every `unsafe` call of this module is a query on a device list or an open context that the
//! module owns; the safe types hand out plain Rust values.

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::os::raw::c_int;
use std::ptr::NonNull;

use rdma_sys as sys;

use super::error::VerbsError;

/// `ibv_port_attr::link_layer` values (an anonymous C enum that bindgen leaves out).
pub(crate) const LINK_LAYER_INFINIBAND: u8 = 1;
pub(crate) const LINK_LAYER_ETHERNET: u8 = 2;

/// The device array libibverbs hands out; freed on drop.
struct DeviceList {
    list: NonNull<*mut sys::ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<Self, VerbsError> {
        let mut len: c_int = 0;
        // SAFETY: `len` is a valid out-pointer. A non-null result is an array of `len` device
        // pointers that we own until `ibv_free_device_list` (in Drop).
        let list = unsafe { sys::ibv_get_device_list(&mut len) };
        match NonNull::new(list) {
            Some(list) => Ok(Self { list, len: usize::try_from(len).unwrap_or(0) }),
            // ENOSYS here means the kernel has no RDMA support (no uverbs).
            None => Err(VerbsError::NoDevice {
                detail: format!("ibv_get_device_list: {}", std::io::Error::last_os_error()),
            }),
        }
    }

    fn device(&self, index: usize) -> *mut sys::ibv_device {
        assert!(index < self.len);
        // SAFETY: `index < len`, and the array stays valid until Drop.
        unsafe { *self.list.as_ptr().add(index) }
    }

    fn name(&self, index: usize) -> String {
        // SAFETY: the device pointer comes from the live list; ibv_get_device_name returns a
        // NUL-terminated string owned by the device (or null), which we copy at once.
        unsafe {
            let name = sys::ibv_get_device_name(self.device(index));
            if name.is_null() {
                return format!("device{index}");
            }
            CStr::from_ptr(name).to_string_lossy().into_owned()
        }
    }

    fn names(&self) -> Vec<String> {
        (0..self.len).map(|i| self.name(i)).collect()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed exactly once. Contexts
        // opened from it stay valid (libibverbs reference-counts devices).
        unsafe { sys::ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// Device limits the backend sizes its queues by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceCaps {
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    /// Responder resources per QP (incoming READ/atomic in flight).
    pub max_qp_rd_atom: u32,
    /// Initiator depth per QP (outgoing READ/atomic in flight).
    pub max_qp_init_rd_atom: u32,
    /// `ibv_atomic_cap`: 0 none, 1 HCA (atomic w.r.t. this NIC only), 2 global.
    pub atomic_cap: u32,
    pub ports: u8,
    pub max_mr_size: u64,
}

/// One port's state.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PortAttr {
    pub state: u32,
    pub active_mtu: u32,
    pub lid: u16,
    pub link_layer: u8,
    pub gid_tbl_len: u32,
}

impl PortAttr {
    pub fn is_active(&self) -> bool {
        self.state == sys::ibv_port_state::IBV_PORT_ACTIVE
    }
}

/// An open device (`ibv_context`); closed on drop, after everything made from it (the
/// objects made from it hold an `Arc` to it).
pub(crate) struct Context {
    raw: NonNull<sys::ibv_context>,
    name: String,
    caps: DeviceCaps,
}

// SAFETY: an ibv_context may be used from any thread: libibverbs serializes its control
// calls, and this type exposes only queries on it.
unsafe impl Send for Context {}
// SAFETY: as above; `&Context` allows only thread-safe queries.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device called `wanted`, or else the first device that has an active port.
    pub fn open(wanted: Option<&str>) -> Result<Self, VerbsError> {
        let list = DeviceList::get()?;
        if list.len == 0 {
            return Err(VerbsError::NoDevice { detail: "ibv_get_device_list returned 0 devices".into() });
        }
        let names = list.names();
        if let Some(wanted) = wanted {
            let index = names
                .iter()
                .position(|n| n == wanted)
                .ok_or_else(|| VerbsError::DeviceNotFound { wanted: wanted.to_string(), found: names.join(", ") })?;
            return Self::open_at(&list, index);
        }
        let mut why = Vec::new();
        for index in 0..list.len {
            let ctx = match Self::open_at(&list, index) {
                Ok(ctx) => ctx,
                Err(e) => {
                    why.push(e.to_string());
                    continue;
                }
            };
            if ctx.first_active_port().is_some() {
                return Ok(ctx);
            }
            why.push(format!("{}: no port is ACTIVE", ctx.name));
        }
        Err(VerbsError::NoActivePort { device: names.join(", "), detail: why.join("; ") })
    }

    fn open_at(list: &DeviceList, index: usize) -> Result<Self, VerbsError> {
        let name = list.name(index);
        // SAFETY: the device pointer comes from the live list. A non-null context is ours
        // until ibv_close_device (in Drop).
        let raw = unsafe { sys::ibv_open_device(list.device(index)) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::null("ibv_open_device", &name))?;
        let mut attr = MaybeUninit::<sys::ibv_device_attr>::zeroed();
        // SAFETY: `raw` is an open context and `attr` is a writable ibv_device_attr.
        let ret = unsafe { sys::ibv_query_device(raw.as_ptr(), attr.as_mut_ptr()) };
        if ret != 0 {
            let err = VerbsError::call("ibv_query_device", &name, ret);
            // SAFETY: closing the context we just opened; nothing else refers to it.
            unsafe { sys::ibv_close_device(raw.as_ptr()) };
            return Err(err);
        }
        // SAFETY: ibv_query_device succeeded and filled the struct (all-zero is valid too).
        let attr = unsafe { attr.assume_init() };
        let non_negative = |v: c_int| u32::try_from(v).unwrap_or(0);
        let caps = DeviceCaps {
            max_qp_wr: non_negative(attr.max_qp_wr),
            max_cqe: non_negative(attr.max_cqe),
            max_qp_rd_atom: non_negative(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: non_negative(attr.max_qp_init_rd_atom),
            atomic_cap: attr.atomic_cap,
            ports: attr.phys_port_cnt,
            max_mr_size: attr.max_mr_size,
        };
        Ok(Self { raw, name, caps })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn caps(&self) -> DeviceCaps {
        self.caps
    }

    /// The raw context, for the other verbs modules (which own what they create from it).
    pub(super) fn raw(&self) -> *mut sys::ibv_context {
        self.raw.as_ptr()
    }

    pub fn port(&self, port: u8) -> Result<PortAttr, VerbsError> {
        let mut attr = MaybeUninit::<sys::ibv_port_attr>::zeroed();
        // SAFETY: an open context and a writable, zeroed ibv_port_attr (___ibv_query_port is
        // what the C macro ibv_query_port expands to; it passes the struct size).
        let ret = unsafe { sys::___ibv_query_port(self.raw(), port, attr.as_mut_ptr()) };
        if ret != 0 {
            return Err(VerbsError::call("ibv_query_port", &self.name, ret));
        }
        // SAFETY: filled by a successful query (and all-zero is a valid value anyway).
        let attr = unsafe { attr.assume_init() };
        Ok(PortAttr {
            state: attr.state,
            active_mtu: attr.active_mtu,
            lid: attr.lid,
            link_layer: attr.link_layer,
            gid_tbl_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
        })
    }

    pub fn first_active_port(&self) -> Option<u8> {
        (1..=self.caps.ports).find(|&p| self.port(p).map(|a| a.is_active()).unwrap_or(false))
    }

    /// GID `index` of `port`, in network byte order.
    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16], VerbsError> {
        let index =
            c_int::try_from(index).map_err(|_| VerbsError::Unsupported(format!("GID index {index} out of range")))?;
        let mut gid = MaybeUninit::<sys::ibv_gid>::zeroed();
        // SAFETY: an open context and a writable ibv_gid.
        let ret = unsafe { sys::ibv_query_gid(self.raw(), port, index, gid.as_mut_ptr()) };
        if ret != 0 {
            return Err(VerbsError::call("ibv_query_gid", &self.name, ret));
        }
        // SAFETY: ibv_gid is a union of POD views of the same 16 bytes; every bit pattern is
        // a valid `raw: [u8; 16]`.
        Ok(unsafe { gid.assume_init().raw })
    }

    /// The GID type the kernel reports ("IB/RoCE v1" or "RoCE v2"), when sysfs has it.
    pub fn gid_type(&self, port: u8, index: u32) -> Option<String> {
        let path = format!("/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{index}", self.name);
        std::fs::read_to_string(path).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object made from this context holds an Arc to it, so none is left
        // when the last reference drops; the context is closed exactly once.
        let ret = unsafe { sys::ibv_close_device(self.raw()) };
        if ret != 0 {
            tracing::warn!("ibv_close_device({}) failed: {}", self.name, std::io::Error::last_os_error());
        }
    }
}

/// True for `::ffff:a.b.c.d`, the GID form RoCE v2 uses for an IPv4 address.
pub(crate) fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// Formats a GID like an IPv6 address (which a RoCE GID is).
pub(crate) fn format_gid(gid: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

/// What one GID table entry holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidInfo {
    /// Its index in the port's GID table.
    pub index: u32,
    /// As an IPv6 address.
    pub gid: String,
    /// "IB/RoCE v1" or "RoCE v2", when the kernel says.
    pub kind: Option<String>,
}

/// One port of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (from 1).
    pub port: u8,
    /// Whether the port is in the ACTIVE state.
    pub active: bool,
    /// "InfiniBand", "Ethernet" (RoCE) or "unknown".
    pub link_layer: &'static str,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The non-empty GID entries.
    pub gids: Vec<GidInfo>,
}

/// One RDMA device, as [`super::devices`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name (e.g. `rxe0`, `mlx5_0`).
    pub name: String,
    /// Most work requests a queue pair may hold.
    pub max_qp_wr: u32,
    /// "none", "hca" (atomic only with respect to this NIC) or "global".
    pub atomic_cap: &'static str,
    /// Its ports.
    pub ports: Vec<PortInfo>,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}: max_qp_wr {}, atomics {}", self.name, self.max_qp_wr, self.atomic_cap)?;
        for p in &self.ports {
            writeln!(
                f,
                "  port {}: {}, {}, mtu {}, lid {}",
                p.port,
                if p.active { "ACTIVE" } else { "not active" },
                p.link_layer,
                p.mtu,
                p.lid
            )?;
            for g in &p.gids {
                writeln!(f, "    gid {}: {} ({})", g.index, g.gid, g.kind.as_deref().unwrap_or("type unknown"))?;
            }
        }
        Ok(())
    }
}

/// Bytes of an `ibv_mtu` code (1 = 256 .. 5 = 4096; 0 if unknown).
pub(crate) fn mtu_bytes(code: u32) -> u32 {
    if (1..=5).contains(&code) {
        128 << code
    } else {
        0
    }
}

fn describe(ctx: &Context) -> DeviceInfo {
    let caps = ctx.caps();
    let ports = (1..=caps.ports)
        .filter_map(|port| {
            let attr = ctx.port(port).ok()?;
            let gids = (0..attr.gid_tbl_len)
                .filter_map(|index| {
                    let gid = ctx.gid(port, index).ok()?;
                    (gid != [0; 16]).then(|| GidInfo { index, gid: format_gid(&gid), kind: ctx.gid_type(port, index) })
                })
                .collect();
            Some(PortInfo {
                port,
                active: attr.is_active(),
                link_layer: match attr.link_layer {
                    LINK_LAYER_INFINIBAND => "InfiniBand",
                    LINK_LAYER_ETHERNET => "Ethernet",
                    _ => "unknown",
                },
                mtu: mtu_bytes(attr.active_mtu),
                lid: attr.lid,
                gids,
            })
        })
        .collect();
    DeviceInfo {
        name: ctx.name().to_string(),
        max_qp_wr: caps.max_qp_wr,
        atomic_cap: match caps.atomic_cap {
            0 => "none",
            1 => "hca",
            _ => "global",
        },
        ports,
    }
}

/// Every RDMA device this host has, with ports and GIDs. No device is an empty list, not an
/// error (a host without RDMA support at all too).
pub fn devices() -> Result<Vec<DeviceInfo>, VerbsError> {
    let list = match DeviceList::get() {
        Ok(list) => list,
        Err(VerbsError::NoDevice { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    (0..list.len).map(|index| Context::open_at(&list, index).map(|ctx| describe(&ctx))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_helpers() {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 77, 0, 1]);
        assert!(is_ipv4_mapped(&gid));
        assert_eq!(format_gid(&gid), "::ffff:10.77.0.1");
        gid[0] = 0xfe;
        assert!(!is_ipv4_mapped(&gid));
        assert_eq!((mtu_bytes(1), mtu_bytes(3), mtu_bytes(5), mtu_bytes(9)), (256, 1024, 4096, 0));
    }
}
