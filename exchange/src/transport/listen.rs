//! How a worker accepts connections: at most a fixed number open at once (one more is
//! closed at once, with a warning, instead of queuing behind the others), and, under TLS, a
//! handshake that must finish within [`HANDSHAKE_TIMEOUT`] (see [`super::tls`]). A peer that
//! opens connections and never speaks cannot exhaust the worker's sockets or memory.

use futures::{Stream, StreamExt};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

/// Connections a worker keeps open at once by default. A cluster needs one per peer and one
/// per driver or client: thousands are room for large clusters, not for a flood.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// A TLS client must finish its handshake within this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// An accepted connection holding one of the worker's connection slots until it closes.
pub struct Capped {
    io: TcpStream,
    _slot: OwnedSemaphorePermit,
}

impl Connected for Capped {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl AsyncRead for Capped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Capped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// The connections `listener` accepts (with `TCP_NODELAY`), at most `max` open at once.
pub fn capped(
    listener: TcpListener,
    max: usize,
) -> impl Stream<Item = io::Result<Capped>> + Send + 'static {
    let slots = Arc::new(Semaphore::new(max.max(1)));
    // tonic applies `Server::tcp_nodelay` only when it binds the socket itself; with our own
    // listener the incoming stream must set it, or every small reply waits for a delayed ACK.
    TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .filter_map(move |accepted| {
            let slots = slots.clone();
            async move {
                let io = match accepted {
                    Ok(io) => io,
                    Err(e) => return Some(Err(e)),
                };
                match slots.try_acquire_owned() {
                    Ok(slot) => Some(Ok(Capped { io, _slot: slot })),
                    Err(_) => {
                        let from = io.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                        tracing::warn!(
                            from,
                            max,
                            "connection refused: the worker has its maximum of connections open"
                        );
                        None
                    }
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn a_connection_beyond_the_cap_is_closed_and_a_closed_one_frees_its_slot() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Box::pin(capped(listener, 2));
        let a = TcpStream::connect(addr).await.unwrap();
        let _held_a = incoming.next().await.unwrap().unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        let _held_b = incoming.next().await.unwrap().unwrap();
        // A third is accepted by the kernel, then closed by the worker: the client reads EOF.
        let mut c = TcpStream::connect(addr).await.unwrap();
        let next = tokio::time::timeout(Duration::from_millis(300), incoming.next()).await;
        assert!(next.is_err(), "a connection beyond the cap was handed out");
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
            .await
            .expect("the refused connection was left open")
            .unwrap_or(0);
        assert_eq!(n, 0);
        // Closing one held connection frees a slot for the next.
        drop(_held_a);
        drop(a);
        let _d = TcpStream::connect(addr).await.unwrap();
        let next = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(next.is_ok_and(|c| c.is_some_and(|c| c.is_ok())));
    }
}
