//! What wakes a relayed connection: its two sockets, watched for readability
//! only, and [`Wake`], one part of the connection waking another.
//!
//! A tokio `UnixStream` is registered for reading and writing, edge-triggered:
//! every time the peer reads what the relay wrote, the kernel reports the socket
//! writable and wakes the relay's thread, for nothing. On a small CRI call that
//! is about one wake-up in three (an IPI and a halted vCPU woken on a VM). A
//! [`Socket`] is registered for readability alone; a write goes straight to the
//! socket, and only when the socket's buffer is full is a second descriptor of
//! it registered for writability, until the write is done.

use std::future::poll_fn;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;

use bytes::BytesMut;
use futures_util::task::AtomicWaker;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// What one read asks the socket for at most.
pub(crate) const READ_CHUNK: usize = 64 * 1024;

/// One end of a relayed connection: read by one loop, written by the other.
pub(crate) struct Socket {
    fd: AsyncFd<UnixStream>,
}

impl Socket {
    /// Takes `stream` off tokio's reactor and registers it for readability only.
    pub(crate) fn new(stream: tokio::net::UnixStream) -> io::Result<Self> {
        Ok(Self {
            fd: register(stream.into_std()?, Interest::READABLE)?,
        })
    }

    /// Waits for bytes and appends what one read gives to `input`, through
    /// `scratch` (a read into `BytesMut`'s spare room needs `unsafe`); `Ok(0)` at
    /// the end of the stream. Cancel-safe: nothing is read before the last await.
    ///
    /// An empty `input` that nothing else holds a part of, and that has less than
    /// [`READ_CHUNK`] of room left, starts again at the front of its buffer:
    /// frames split off one by one would otherwise walk each read onto lines of
    /// the buffer not touched since it last wrapped, cold in the cache (0–5 µs a
    /// call at p50 on the development VM, docs/benchmarks.md). A buffer grown past
    /// 64 KiB (a large message) walks until that much room is left, then comes back.
    pub(crate) async fn read(&self, input: &mut BytesMut, scratch: &mut [u8]) -> io::Result<usize> {
        if input.is_empty() {
            // False when a part is still held elsewhere: then it stays as it is.
            let _ = input.try_reclaim(READ_CHUNK);
        }
        loop {
            let mut ready = self.fd.readable().await?;
            match ready.try_io(|fd| fd.get_ref().read(scratch)) {
                Ok(Ok(n)) => {
                    // Edge-triggered: a read that did not fill the buffer drained
                    // the socket, so the next one would only say WouldBlock.
                    if n > 0 && n < scratch.len() {
                        ready.clear_ready();
                    }
                    input.extend_from_slice(&scratch[..n]);
                    return Ok(n);
                }
                Ok(Err(error)) if error.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(error)) => return Err(error),
                // WouldBlock: readiness cleared, wait again.
                Err(_would_block) => {}
            }
        }
    }

    /// Writes what of `bytes` the socket's buffer takes now, without waiting:
    /// how many bytes went.
    pub(crate) fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        let mut written = 0;
        while written < bytes.len() {
            match self.fd.get_ref().write(&bytes[written..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => written += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                Err(error) => return Err(error),
            }
        }
        Ok(written)
    }

    /// Writes all of `bytes`: straight to the socket, waiting for room only when
    /// its buffer is full.
    pub(crate) async fn write_all(&self, mut bytes: &[u8]) -> io::Result<()> {
        let mut room: Option<AsyncFd<UnixStream>> = None;
        loop {
            bytes = &bytes[self.try_write(bytes)?..];
            if bytes.is_empty() {
                return Ok(());
            }
            let fd = match &room {
                Some(fd) => fd,
                // A second descriptor of the same socket, registered for
                // writability: epoll reports it at once if room came meanwhile.
                None => room.insert(register(
                    self.fd.get_ref().try_clone()?,
                    Interest::WRITABLE,
                )?),
            };
            fd.writable().await?.clear_ready();
        }
    }

    /// Ends the writing direction: the peer reads end of stream.
    pub(crate) fn shutdown_write(&self) {
        let _ = self.fd.get_ref().shutdown(Shutdown::Write);
    }
}

/// Registers `stream` with tokio's reactor for `interest`.
///
/// tokio 1.54 deprecates the safe constructor for an `AsyncFd` whose `AsRawFd`
/// could hand back another descriptor later; a `UnixStream` owns its one
/// descriptor until it is dropped with the `AsyncFd`, which is what the
/// `unsafe` constructor asks, and this crate forbids `unsafe`.
#[allow(deprecated)]
fn register(stream: UnixStream, interest: Interest) -> io::Result<AsyncFd<UnixStream>> {
    AsyncFd::with_interest(stream, interest)
}

// === impl Wake ===

/// A wake-up for the one task that waits on it (a relay loop), from the other
/// loop or a lifecycle call's task; one that comes while nobody waits is kept
/// for the next wait. A flag and a waker: unlike `tokio::sync::Notify` it takes
/// no lock on each poll, and a loop polls it on every read.
#[derive(Debug, Default)]
pub(crate) struct Wake {
    pending: AtomicBool,
    waker: AtomicWaker,
}

impl Wake {
    /// Wakes the waiter, or the next wait if none is waiting.
    pub(crate) fn notify(&self) {
        self.pending.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Resolves at the first wake-up since the last one it resolved at.
    /// Cancel-safe: a wake-up is taken only when it resolves.
    pub(crate) async fn notified(&self) {
        poll_fn(|cx| {
            if self.pending.swap(false, Ordering::AcqRel) {
                return Poll::Ready(());
            }
            self.waker.register(cx.waker());
            // A wake-up between the check and the registration woke the old waker.
            if self.pending.swap(false, Ordering::AcqRel) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// The event masks epoll holds for descriptor `fd`, from every epoll
    /// instance of this process (`/proc/self/fdinfo`).
    fn epoll_masks(fd: i32) -> Vec<u32> {
        let mut masks = Vec::new();
        for entry in std::fs::read_dir("/proc/self/fd")
            .expect("fd dir")
            .flatten()
        {
            let target = std::fs::read_link(entry.path()).unwrap_or_default();
            if target.as_os_str() != "anon_inode:[eventpoll]" {
                continue;
            }
            let info = format!("/proc/self/fdinfo/{}", entry.file_name().to_string_lossy());
            let Ok(info) = std::fs::read_to_string(info) else {
                continue;
            };
            for line in info.lines() {
                let mut words = line.split_whitespace();
                if words.next() == Some("tfd:") && words.next() == Some(&fd.to_string()) {
                    let events = words.skip_while(|w| *w != "events:").nth(1);
                    masks.push(u32::from_str_radix(events.expect("events"), 16).expect("hex"));
                }
            }
        }
        masks
    }

    const EPOLLIN: u32 = 0x1;
    const EPOLLOUT: u32 = 0x4;

    #[tokio::test]
    async fn a_socket_is_watched_for_reading_only() {
        let (ours, _peer) = tokio::net::UnixStream::pair().expect("pair");
        // What tokio itself registers: the peer's reads would wake this thread.
        assert!(
            epoll_masks(ours.as_raw_fd())
                .iter()
                .any(|m| m & EPOLLOUT != 0)
        );
        let socket = Socket::new(ours).expect("socket");
        // Other tests' epoll instances may list a descriptor of the same number.
        let masks = epoll_masks(socket.fd.as_raw_fd());
        assert!(!masks.is_empty());
        for mask in masks {
            assert_eq!(mask & (EPOLLIN | EPOLLOUT), EPOLLIN, "{mask:#x}");
        }
    }

    #[tokio::test]
    async fn reads_append_and_end_at_end_of_stream() {
        let (ours, mut peer) = tokio::net::UnixStream::pair().expect("pair");
        let socket = Socket::new(ours).expect("socket");
        let mut input = BytesMut::from(&b"kept "[..]);
        let mut scratch = vec![0; 4];
        peer.write_all(b"abcdef").await.expect("write");
        // A full scratch buffer leaves the socket readable: the rest comes next.
        assert_eq!(
            socket.read(&mut input, &mut scratch).await.expect("read"),
            4
        );
        assert_eq!(
            socket.read(&mut input, &mut scratch).await.expect("read"),
            2
        );
        assert_eq!(&input[..], b"kept abcdef");
        // A short read cleared readiness; new bytes wake it again.
        let reader = async {
            let n = socket.read(&mut input, &mut scratch).await.expect("read");
            (n, input)
        };
        let writer = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            peer.write_all(b"g").await.expect("write");
            peer
        };
        let ((n, mut input), peer) = tokio::join!(reader, writer);
        assert_eq!((n, &input[..]), (1, &b"kept abcdefg"[..]));
        drop(peer);
        assert_eq!(socket.read(&mut input, &mut scratch).await.expect("eof"), 0);
    }

    #[tokio::test]
    async fn reads_start_again_at_the_front_once_what_was_read_is_gone() {
        let (ours, mut peer) = tokio::net::UnixStream::pair().expect("pair");
        let socket = Socket::new(ours).expect("socket");
        let mut input = BytesMut::with_capacity(READ_CHUNK);
        let front = input.as_ptr();
        let mut scratch = vec![0; READ_CHUNK];
        peer.write_all(b"first frame").await.expect("write");
        socket.read(&mut input, &mut scratch).await.expect("read");
        // A frame split off and still held (on its way out): the next read goes
        // after it, in the same buffer.
        let held = input.split();
        peer.write_all(b"second").await.expect("write");
        socket.read(&mut input, &mut scratch).await.expect("read");
        assert_eq!(&input[..], b"second");
        assert_eq!(input.as_ptr(), front.wrapping_add(held.len()));
        // Both gone: the next read lands at the front again.
        drop(held);
        drop(input.split());
        peer.write_all(b"third").await.expect("write");
        socket.read(&mut input, &mut scratch).await.expect("read");
        assert_eq!(&input[..], b"third");
        assert_eq!(input.as_ptr(), front);
    }

    #[tokio::test]
    async fn a_write_past_the_socket_buffer_waits_for_room() {
        let (ours, mut peer) = tokio::net::UnixStream::pair().expect("pair");
        let socket = Arc::new(Socket::new(ours).expect("socket"));
        // Far more than a unix socket buffers: the write must wait for the peer.
        let sent: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
        let writer = {
            let socket = Arc::clone(&socket);
            let sent = sent.clone();
            tokio::spawn(async move {
                socket.write_all(&sent).await.expect("write");
                socket.shutdown_write();
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!writer.is_finished(), "8 MiB fit in the socket buffer?");
        let mut received = Vec::new();
        peer.read_to_end(&mut received).await.expect("read");
        writer.await.expect("writer");
        assert!(received == sent, "bytes arrive whole and in order");
    }

    #[tokio::test]
    async fn a_wake_up_is_kept_until_taken_and_taken_once() {
        let wake = Arc::new(Wake::default());
        wake.notify();
        wake.notified().await;
        // Taken: the next wait waits for the next wake-up.
        let waiting = tokio::spawn({
            let wake = Arc::clone(&wake);
            async move { wake.notified().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        wake.notify();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken")
            .expect("task");
        // A wait given up before a wake-up leaves the wake-up for the next one.
        let given_up = tokio::time::timeout(Duration::from_millis(10), wake.notified()).await;
        assert!(given_up.is_err());
        wake.notify();
        tokio::time::timeout(Duration::from_secs(5), wake.notified())
            .await
            .expect("kept");
    }
}
