//! Passing the region's file descriptor over a Unix socket (SCM_RIGHTS), through nix.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr};

/// Sends all of `bytes`, with `fd` attached to the first segment.
pub(crate) fn send_with_fd(stream: &mut UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let sent = sendmsg::<UnixAddr>(stream.as_raw_fd(), &[IoSlice::new(bytes)], &cmsg, MsgFlags::empty(), None)
        .map_err(io::Error::from)?;
    if sent < bytes.len() {
        use std::io::Write;
        stream.write_all(&bytes[sent..])?;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and at most one attached descriptor.
/// Extra descriptors (a confused or hostile peer) are closed, never leaked.
pub(crate) fn recv_with_fd(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut cmsg_space = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<UnixAddr>(stream.as_raw_fd(), &mut iov, Some(&mut cmsg_space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut received = None;
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for raw in fds {
                // SAFETY: the kernel just installed `raw` in our table for this message and
                // nothing else owns it; wrapping it in OwnedFd makes it closed exactly once.
                let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                if received.is_none() {
                    received = Some(owned);
                }
            }
        }
    }
    Ok((msg.bytes, received))
}
