//! The HTTP/1.1 accept loop of `strata serve` (hyper, under the axum router), with what `axum::serve` lacks
//! (issue 19, points 1 and 4):
//! - a deadline on each request's header ([`HEADER_TIMEOUT`]): a connection that sends part of a header, or
//!   nothing, or sits idle between keep-alive requests, is closed, so silent clients cannot hold sockets for ever;
//! - a limit on open connections below the process's file limit ([`connection_limit`]), so the server keeps the
//!   descriptors it needs (the worker's pipes, the model file). At the limit, a new connection takes the place of
//!   the oldest idle one: one that has sent nothing yet (a silent client's) first, else one between keep-alive
//!   requests; when every one is answering a request, the new one is closed at once;
//! - a drain: on Ctrl-C or SIGTERM the listener closes and connections finish what they are answering; at the
//!   `drain` deadline the answers still running are ended (`at_deadline`: an error event for a stream), given
//!   [`FLUSH`] to reach their clients, and the rest dropped.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinSet;
use tower_service::Service;

/// An open connection as the accept loop sees it: whether it has started a request, how many of its answers are
/// being made or sent, and how to close it.
struct Open {
    started: Arc<AtomicBool>,
    active: Arc<AtomicUsize>,
    /// Set when the connection has ended (its entry is then dropped from the queue).
    ended: Arc<AtomicBool>,
    evict: Arc<Notify>,
}

/// One answer under way on a connection: counted in its `active` while alive.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(active: Arc<AtomicUsize>) -> Busy {
        active.fetch_add(1, Ordering::SeqCst);
        Busy(active)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Closes the oldest idle connection: one that has not started a request, else one with no answer under way;
/// whether there was one.
fn evict_idle(open: &Mutex<VecDeque<Open>>) -> bool {
    let mut q = open.lock().unwrap_or_else(|p| p.into_inner());
    q.retain(|o| !o.ended.load(Ordering::Relaxed));
    let idle = |o: &Open| o.active.load(Ordering::SeqCst) == 0;
    let silent = q.iter().position(|o| !o.started.load(Ordering::Relaxed) && idle(o));
    match silent.or_else(|| q.iter().position(idle)) {
        Some(i) => {
            let o = q.remove(i).expect("found");
            o.evict.notify_one();
            true
        }
        None => false,
    }
}

/// How long a client may take to send a request's header, and how long a keep-alive connection may sit idle
/// before its next request.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long answers ended at the drain deadline get to reach their clients.
pub const FLUSH: Duration = Duration::from_secs(1);

/// File descriptors kept back from connections: the listener, the worker's pipes, the model file, logs.
const FDS_KEPT: u64 = 64;

/// The most connections served at once: 1,024, or the soft open-file limit less [`FDS_KEPT`] when that is lower
/// (at least 16).
pub fn connection_limit() -> usize {
    let mut lim = 1024u64;
    #[cfg(unix)]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 && r.rlim_cur != libc::RLIM_INFINITY {
            lim = lim.min(r.rlim_cur.saturating_sub(FDS_KEPT));
        }
    }
    lim.max(16) as usize
}

/// Serves `app` on `listener` until `stop` resolves, then drains for at most `drain`, or until `again` resolves
/// (a second interrupt), whichever comes first (see the module's doc).
/// `on_refused` is called for each connection closed at once because `limit` were open.
///
/// Errors: none once serving; accept errors (a full file table) are waited out.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limit: usize,
    drain: Duration,
    stop: impl std::future::Future<Output = ()>,
    again: impl std::future::Future<Output = ()>,
    at_deadline: impl FnOnce(),
    on_refused: impl Fn() + Send + Sync + 'static,
) {
    let slots = Arc::new(Semaphore::new(limit));
    let open: Mutex<VecDeque<Open>> = Mutex::new(VecDeque::new());
    let (stopping_tx, stopping) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(stop);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut stop => break,
            // Reap finished connections as they end, so the set stays small.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(_) => {
                    // Out of descriptors, or a connection reset before it was accepted: try again shortly.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            // Full: an idle connection makes room, if there is one.
            Err(_) if evict_idle(&open) => {
                match tokio::time::timeout(Duration::from_secs(1), slots.clone().acquire_owned()).await {
                    Ok(Ok(p)) => p,
                    _ => {
                        on_refused();
                        continue;
                    }
                }
            }
            Err(_) => {
                on_refused();
                drop(stream);
                continue;
            }
        };
        let me = Open {
            started: Arc::new(AtomicBool::new(false)),
            active: Arc::new(AtomicUsize::new(0)),
            ended: Arc::new(AtomicBool::new(false)),
            evict: Arc::new(Notify::new()),
        };
        let (started, active, ended, evict) = (
            me.started.clone(),
            me.active.clone(),
            me.ended.clone(),
            me.evict.clone(),
        );
        {
            let mut q = open.lock().unwrap_or_else(|p| p.into_inner());
            q.retain(|o| !o.ended.load(Ordering::Relaxed));
            q.push_back(me);
        }
        let app = app.clone();
        let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            started.store(true, Ordering::Relaxed);
            // Under way until the answer's body has been sent (or dropped): a stream keeps its connection busy.
            let busy = Busy::new(active.clone());
            // A Router is always ready: `call` needs no `poll_ready` first.
            let answer = app.clone().call(req);
            async move {
                let resp = answer.await?;
                Ok::<_, std::convert::Infallible>(resp.map(|body| {
                    axum::body::Body::new(http_body_util::BodyExt::map_frame(body, move |frame| {
                        let _ = &busy;
                        frame
                    }))
                }))
            }
        });
        let mut stopping = stopping.clone();
        conns.spawn(async move {
            let _permit = permit;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT);
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = evict.notified() => {}
                _ = async { let _ = stopping.wait_for(|s| *s).await; } => {
                    // Finish the answer in flight, take no new request.
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            ended.store(true, Ordering::Relaxed);
        });
    }
    drop(listener);
    let _ = stopping_tx.send(true);
    // A second Ctrl-C or SIGTERM ends the drain at once.
    let finished = tokio::select! {
        r = tokio::time::timeout(drain, async {
            while conns.join_next().await.is_some() {}
        }) => r.is_ok(),
        _ = again => false,
    };
    if !finished {
        at_deadline();
        let _ = tokio::time::timeout(FLUSH, async { while conns.join_next().await.is_some() {} }).await;
    }
    conns.abort_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_limit_leaves_descriptors_for_the_server() {
        let n = connection_limit();
        assert!((16..=1024).contains(&n), "{n}");
    }
}
