//! Errors of the verbs layer (device setup, queue pairs, work requests).

use std::io;

/// What to do instead when there is no usable RDMA device; every "no device" message ends
/// with it.
pub const NO_DEVICE_HINT: &str = "use an shm: endpoint (same host) or a tcp: endpoint (any host) instead, \
     or create a Soft-RoCE device on an interface that is up: \
     `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <if>`";

/// Why a verbs call or the setup around it failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// libibverbs found no RDMA device (or the kernel has no RDMA support at all).
    #[error("no RDMA device found ({detail}); {NO_DEVICE_HINT}")]
    NoDevice {
        /// What libibverbs said.
        detail: String,
    },
    /// `RACEKV_RDMA_DEVICE` names a device that is not there.
    #[error("RDMA device {wanted:?} not found (found: {found}); unset RACEKV_RDMA_DEVICE to use the first device with an active port")]
    DeviceNotFound {
        /// The device named.
        wanted: String,
        /// The devices there are.
        found: String,
    },
    /// The device has no port in the ACTIVE state (for Soft-RoCE: its interface is down).
    #[error("RDMA device {device} has no active port ({detail}); bring its network interface up, or {NO_DEVICE_HINT}")]
    NoActivePort {
        /// The devices looked at.
        device: String,
        /// Why none of their ports would do.
        detail: String,
    },
    /// A verbs call failed.
    #[error("{call} failed on {device}: {source}")]
    Call {
        /// The verbs function that failed.
        call: &'static str,
        /// The device it ran on.
        device: String,
        /// The error it returned.
        #[source]
        source: io::Error,
    },
    /// The device cannot do what the backend needs, or a setting is invalid.
    #[error("{0}")]
    Unsupported(String),
}

impl VerbsError {
    /// A failed call; `ret` is the call's return value (an errno value, or -1 with errno set).
    pub(crate) fn call(call: &'static str, device: &str, ret: i32) -> Self {
        let source = if ret > 0 { io::Error::from_raw_os_error(ret) } else { io::Error::last_os_error() };
        VerbsError::Call { call, device: device.to_string(), source }
    }

    /// A call that returned a null pointer (errno says why).
    pub(crate) fn null(call: &'static str, device: &str) -> Self {
        VerbsError::Call { call, device: device.to_string(), source: io::Error::last_os_error() }
    }

    /// True when the cause is a missing or unusable device, so the caller should switch
    /// transports rather than retry.
    pub fn is_no_device(&self) -> bool {
        matches!(
            self,
            VerbsError::NoDevice { .. } | VerbsError::DeviceNotFound { .. } | VerbsError::NoActivePort { .. }
        )
    }
}

impl From<VerbsError> for io::Error {
    fn from(e: VerbsError) -> Self {
        let kind = if e.is_no_device() { io::ErrorKind::NotFound } else { io::ErrorKind::Other };
        io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_names_every_way_out() {
        let text = VerbsError::NoDevice { detail: "ibv_get_device_list returned 0 devices".into() }.to_string();
        for needle in ["no RDMA device found", "shm:", "tcp:", "rdma link add rxe0 type rxe netdev"] {
            assert!(text.contains(needle), "{text:?} lacks {needle:?}");
        }
        let port = VerbsError::NoActivePort { device: "rxe0".into(), detail: "port 1 is DOWN".into() }.to_string();
        assert!(port.contains("rxe0") && port.contains("tcp:"), "{port}");
    }
}
