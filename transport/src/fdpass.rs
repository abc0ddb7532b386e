//! Passing file descriptors over a Unix socket (SCM_RIGHTS), through nix.
//!
//! Used by the shm backend (the region's memfd) and by the computenode's attach protocol (a
//! shared ring's memfd plus its doorbell eventfds). A receiver takes at most
//! [`MAX_RECEIVED_FDS`] descriptors per message; any others a confused or hostile peer sends
//! are closed, never leaked.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr};

/// Descriptors one received message may carry (beyond this they are closed).
pub const MAX_RECEIVED_FDS: usize = 8;

/// Sends all of `bytes`, with `fd` attached to the first segment.
pub fn send_with_fd(stream: &mut UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    send_with_fds(stream, bytes, &[fd])
}

/// Sends all of `bytes`, with every descriptor of `fds` attached to the first segment (in
/// order). `bytes` must not be empty (a message without data may carry no descriptors).
pub fn send_with_fds(stream: &mut UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if bytes.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "descriptors must ride on at least one byte"));
    }
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let sent = sendmsg::<UnixAddr>(stream.as_raw_fd(), &[IoSlice::new(bytes)], cmsgs, MsgFlags::empty(), None)
        .map_err(io::Error::from)?;
    if sent < bytes.len() {
        use std::io::Write;
        stream.write_all(&bytes[sent..])?;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and at most one attached descriptor.
/// Extra descriptors (a confused or hostile peer) are closed, never leaked.
pub fn recv_with_fd(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let (n, fds) = recv_with_fds(stream, buf, 1)?;
    Ok((n, fds.into_iter().next()))
}

/// Receives up to `buf.len()` bytes and at most `max_fds` (capped at [`MAX_RECEIVED_FDS`])
/// attached descriptors, in the order they were sent. Extra descriptors are closed.
pub fn recv_with_fds(stream: &UnixStream, buf: &mut [u8], max_fds: usize) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut cmsg_space = nix::cmsg_space!([RawFd; MAX_RECEIVED_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<UnixAddr>(stream.as_raw_fd(), &mut iov, Some(&mut cmsg_space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut received = Vec::new();
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for raw in fds {
                // SAFETY: the kernel just installed `raw` in our table for this message and
                // nothing else owns it; wrapping it in OwnedFd makes it closed exactly once.
                let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                if received.len() < max_fds.min(MAX_RECEIVED_FDS) {
                    received.push(owned);
                }
            }
        }
    }
    Ok((msg.bytes, received))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::AsFd;

    #[test]
    fn several_descriptors_arrive_in_order_and_extras_are_closed() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let mut files: Vec<std::fs::File> = (0..3).map(|_| tempfile::tempfile().unwrap()).collect();
        for (i, f) in files.iter_mut().enumerate() {
            write!(f, "file {i}").unwrap();
        }
        let fds: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
        send_with_fds(&mut a, b"hello", &fds).unwrap();
        let mut buf = [0u8; 16];
        let (n, got) = recv_with_fds(&b, &mut buf, 2).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(got.len(), 2);
        for (i, fd) in got.into_iter().enumerate() {
            let mut f = std::fs::File::from(fd);
            f.seek(SeekFrom::Start(0)).unwrap();
            let mut text = String::new();
            f.read_to_string(&mut text).unwrap();
            assert_eq!(text, format!("file {i}"));
        }
        assert!(send_with_fds(&mut a, b"", &fds).is_err());
    }
}
