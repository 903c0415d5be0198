//! The FUSE descriptor holder: a tiny process (`ferry daemon --fd-holder SOCKET`) that
//! keeps a copy of every lazy mount's `/dev/fuse` descriptor while the daemon that
//! serves them restarts or crashes, so the kernel keeps those connections — and the
//! running containers' open files on them — alive, and the next daemon resumes them.
//!
//! It holds descriptors and opaque records keyed by a name (the daemon uses the mount
//! point and its own JSON record); it must not interpret them, touch mounts, or read
//! from the descriptors (a read would steal a request from the connection). It exits
//! once no client is connected and it holds nothing, so a node without lazy mounts has
//! no stray process.
//!
//! Protocol: a `SOCK_SEQPACKET` unix socket (one datagram per message, so framing is
//! free and a descriptor travels with exactly the message it belongs to). Each message
//! is one JSON [`Request`] or [`Reply`] of at most [`MAX_MESSAGE`] bytes; `put` carries
//! one descriptor (`SCM_RIGHTS`), and every `entry` reply carries its descriptor. Only
//! peers of the holder's own user are served (`SO_PEERCRED`).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use std::io::{IoSlice, IoSliceMut};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigHandler, Signal, signal};
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag,
    SockType, UnixAddr, sockopt,
};
use nix::sys::time::TimeVal;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Largest message either side sends or accepts.
pub const MAX_MESSAGE: usize = 64 << 10;
/// Longest key (a mount point path).
pub const MAX_KEY: usize = 4096;
/// Longest opaque record.
pub const MAX_META: usize = 16 << 10;
/// Most descriptors held at once.
pub const MAX_ENTRIES: usize = 16384;
/// How long a client waits for the holder's answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the holder's accept loop checks whether it should exit.
const IDLE_CHECK: Duration = Duration::from_millis(250);
/// Every how many idle checks the held descriptors are checked for ended connections.
const PRUNE_EVERY: u32 = 8;

/// What went wrong talking to (or being) the holder.
#[derive(Debug, thiserror::Error)]
pub enum HolderError {
    /// A socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: io::Error,
    },
    /// The peer sent something outside the protocol.
    #[error("fd holder protocol: {0}")]
    Protocol(String),
    /// The holder refused the request.
    #[error("fd holder refused: {0}")]
    Refused(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> HolderError {
    let what = what.into();
    move |source| HolderError::Io { what, source }
}

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Hold the descriptor sent with this message under `key` (replacing and closing
    /// whatever was held under it), with `meta`.
    Put {
        /// The name.
        key: String,
        /// The caller's record, returned as is.
        meta: String,
    },
    /// Close and forget what is held under `key`.
    Remove {
        /// The name.
        key: String,
    },
    /// Send every entry (one `entry` message each, with a copy of its descriptor), then
    /// `end`. The holder keeps them.
    GetAll,
}

/// The holder's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// Done.
    Ok,
    /// `remove`: whether something was held.
    Removed {
        /// True when the key was held.
        existed: bool,
    },
    /// One held entry (its descriptor travels with this message).
    Entry {
        /// The name.
        key: String,
        /// The record given with `put`.
        meta: String,
    },
    /// No more entries.
    End,
    /// The request was refused.
    Error {
        /// Why.
        message: String,
    },
}

/// One entry as [`FdHolderClient::get_all`] returns it.
#[derive(Debug)]
pub struct HeldEntry {
    /// The name it is held under.
    pub key: String,
    /// The record given with `put`.
    pub meta: String,
    /// A copy of the held descriptor (the holder keeps its own).
    pub fd: OwnedFd,
}

/// True when the other end of `fd` is still there: a FUSE connection that ended (or a
/// socket whose peer closed) reports an error or hang-up on poll. Never reads from it
/// (a read on `/dev/fuse` would take a request).
pub fn fd_alive(fd: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).is_ok()
        && !fds[0].revents().is_some_and(|r| {
            r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP | PollFlags::POLLNVAL)
        })
}

/// A connected pair of `SOCK_SEQPACKET` unix sockets (close-on-exec).
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(socket::socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?)
}

fn seqpacket_socket() -> io::Result<OwnedFd> {
    Ok(socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// Bytes of a unix socket path, its terminating NUL included (`sun_path` on Linux).
const SUN_PATH_LEN: usize = 108;

fn sockaddr(path: &Path) -> io::Result<UnixAddr> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() >= SUN_PATH_LEN || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} cannot be a unix socket path", path.display()),
        ));
    }
    Ok(UnixAddr::new(path)?)
}

/// Connects to the holder listening at `path`.
pub fn connect(path: &Path) -> io::Result<OwnedFd> {
    let sock = seqpacket_socket()?;
    let addr = sockaddr(path)?;
    socket::connect(sock.as_raw_fd(), &addr)?;
    Ok(sock)
}

/// Listens at `path` (replacing a stale socket file there), mode 0600.
pub fn listen(path: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::PermissionsExt;
    let sock = seqpacket_socket()?;
    let addr = sockaddr(path)?;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    socket::bind(sock.as_raw_fd(), &addr)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    socket::listen(&sock, Backlog::new(16)?)?;
    Ok(sock)
}

fn set_timeout(sock: BorrowedFd<'_>, timeout: Duration) -> io::Result<()> {
    let tv = TimeVal::new(
        timeout.as_secs() as nix::libc::time_t,
        nix::libc::suseconds_t::from(timeout.subsec_micros() as i32),
    );
    socket::setsockopt(&sock, sockopt::ReceiveTimeout, &tv)?;
    socket::setsockopt(&sock, sockopt::SendTimeout, &tv)?;
    Ok(())
}

/// The peer's user id (`SO_PEERCRED`).
fn peer_uid(sock: BorrowedFd<'_>) -> io::Result<u32> {
    Ok(socket::getsockopt(&sock, sockopt::PeerCredentials)?.uid())
}

/// Sends one message, with `fd` attached when given.
pub fn send_message(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    if bytes.len() > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("message of {} bytes is too large", bytes.len()),
        ));
    }
    let iov = [IoSlice::new(bytes)];
    let raw = fd.map(|fd| [fd.as_raw_fd()]);
    let cmsgs: &[ControlMessage<'_>] = match &raw {
        Some(raw) => &[ControlMessage::ScmRights(raw)],
        None => &[],
    };
    loop {
        match socket::sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(_) => return Err(io::Error::other("short send on a seqpacket socket")),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Descriptors one message may carry before its control message is truncated: room
/// for a few, so extra ones are received (then closed), not lost.
const RECV_FDS: usize = 28;

/// Receives one message: its bytes and the descriptor attached, if any. `None` when the
/// peer closed. A message that is too large, or carries more than one descriptor, is
/// an error (any descriptors it carried are closed).
pub fn recv_message(sock: BorrowedFd<'_>) -> io::Result<Option<(Vec<u8>, Option<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut control = nix::cmsg_space!([RawFd; RECV_FDS]);
    let (n, truncated, fds) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match socket::recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut control),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => {
                let mut fds = Vec::new();
                // A truncated control message cannot be walked (nix refuses): its
                // descriptors, if any, stay unknown; the message is refused below.
                if let Ok(cmsgs) = msg.cmsgs() {
                    for cmsg in cmsgs {
                        if let ControlMessageOwned::ScmRights(raw) = cmsg {
                            // SAFETY: descriptors received by SCM_RIGHTS are new in this
                            // process and owned by nobody else.
                            fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
                        }
                    }
                }
                let truncated = msg
                    .flags
                    .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
                break (msg.bytes, truncated, fds);
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if truncated {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message or its descriptors truncated",
        ));
    }
    let mut fds = fds;
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    if fds.len() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} descriptors in one message", fds.len()),
        ));
    }
    buf.truncate(n);
    Ok(Some((buf, fds.pop())))
}

fn send_json<T: Serialize>(
    sock: BorrowedFd<'_>,
    value: &T,
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
    send_message(sock, &bytes, fd)
}

/// The holder's state: descriptors and records by key.
#[derive(Debug, Default)]
pub struct Holder {
    entries: Mutex<BTreeMap<String, (String, OwnedFd)>>,
    clients: AtomicUsize,
}

impl Holder {
    /// An empty holder.
    pub fn new() -> Holder {
        Holder::default()
    }

    /// How many descriptors are held.
    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn apply(&self, request: Request, fd: Option<OwnedFd>, sock: BorrowedFd<'_>) -> io::Result<()> {
        let refuse = |message: String| send_json(sock, &Reply::Error { message }, None);
        match request {
            Request::Put { key, meta } => {
                let Some(fd) = fd else {
                    return refuse("put without a descriptor".into());
                };
                if key.is_empty() || key.len() > MAX_KEY || meta.len() > MAX_META {
                    return refuse("key or record too large".into());
                }
                let mut entries = self.entries.lock();
                if entries.len() >= MAX_ENTRIES && !entries.contains_key(&key) {
                    drop(entries);
                    return refuse(format!("already holding {MAX_ENTRIES} descriptors"));
                }
                // Replacing closes the previous copy.
                entries.insert(key, (meta, fd));
                drop(entries);
                send_json(sock, &Reply::Ok, None)
            }
            Request::Remove { key } => {
                if fd.is_some() {
                    return refuse("remove carries no descriptor".into());
                }
                let existed = self.entries.lock().remove(&key).is_some();
                send_json(sock, &Reply::Removed { existed }, None)
            }
            Request::GetAll => {
                if fd.is_some() {
                    return refuse("get_all carries no descriptor".into());
                }
                // Copies under the lock, sent without it (a slow client blocks no one).
                let copies: Vec<(String, String, io::Result<OwnedFd>)> = self
                    .entries
                    .lock()
                    .iter()
                    .map(|(k, (m, fd))| (k.clone(), m.clone(), fd.try_clone()))
                    .collect();
                for (key, meta, fd) in copies {
                    let fd = fd?;
                    send_json(sock, &Reply::Entry { key, meta }, Some(fd.as_fd()))?;
                }
                send_json(sock, &Reply::End, None)
            }
        }
    }

    /// Serves one connected client until it closes. Requests that break the protocol
    /// end the connection; the held entries are kept whatever happens.
    pub fn serve_client(&self, sock: OwnedFd) {
        loop {
            let (bytes, fd) = match recv_message(sock.as_fd()) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "fd holder: bad message; closing the connection");
                    break;
                }
            };
            let request: Request = match serde_json::from_slice(&bytes) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "fd holder: not a request; closing the connection");
                    break;
                }
            };
            if let Err(e) = self.apply(request, fd, sock.as_fd()) {
                tracing::warn!(error = %e, "fd holder: answering failed; closing the connection");
                break;
            }
        }
    }

    /// Closes and forgets descriptors whose other end is gone (a FUSE connection that
    /// ended: unmounted, or aborted), so an unmount this holder was not told about (the
    /// daemon was down) does not keep it running for ever. Returns how many went.
    pub fn prune_dead(&self) -> usize {
        let mut entries = self.entries.lock();
        let dead: Vec<String> = entries
            .iter()
            .filter(|(_, (_, fd))| !fd_alive(fd.as_fd()))
            .map(|(k, _)| k.clone())
            .collect();
        for key in &dead {
            entries.remove(key);
            tracing::info!(key, "fd holder: connection ended; released");
        }
        dead.len()
    }

    /// True when no client is connected and nothing is held.
    fn idle(&self) -> bool {
        self.clients.load(Ordering::SeqCst) == 0 && self.is_empty()
    }

    /// Accepts clients on `listener` (one thread each) until, after at least one client
    /// came and went, none is connected and nothing is held — or forever when
    /// `persistent` (a holder run on its own, e.g. as a pod's second container).
    pub fn serve(self: &Arc<Self>, listener: OwnedFd, persistent: bool) -> io::Result<()> {
        let me = nix::unistd::geteuid().as_raw();
        let mut served_one = false;
        let mut ticks = 0u32;
        loop {
            ticks = ticks.wrapping_add(1);
            if ticks.is_multiple_of(PRUNE_EVERY) {
                self.prune_dead();
            }
            if !persistent && served_one && self.idle() {
                return Ok(());
            }
            let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(IDLE_CHECK.as_millis() as u16)) {
                Ok(0) | Err(Errno::EINTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(e.into()),
            }
            let raw = match socket::accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
                Ok(raw) => raw,
                Err(e) => {
                    tracing::warn!(error = %io::Error::from(e), "fd holder: accept failed");
                    continue;
                }
            };
            // SAFETY: a new descriptor owned by nobody else.
            let client = unsafe { OwnedFd::from_raw_fd(raw) };
            match peer_uid(client.as_fd()) {
                Ok(uid) if uid == me || uid == 0 => {}
                Ok(uid) => {
                    tracing::warn!(uid, "fd holder: refused a client of another user");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fd holder: cannot identify a client");
                    continue;
                }
            }
            served_one = true;
            // Counted before the thread starts, so the idle check cannot race it.
            self.clients.fetch_add(1, Ordering::SeqCst);
            let holder = self.clone();
            let spawned = std::thread::Builder::new()
                .name("ferry-fd-holder".into())
                .spawn(move || {
                    holder.serve_client(client);
                    holder.clients.fetch_sub(1, Ordering::SeqCst);
                });
            if let Err(e) = spawned {
                self.clients.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!(error = %e, "fd holder: cannot start a client thread");
            }
        }
    }
}

/// Runs the holder at `socket` until it is idle (see [`Holder::serve`]); what
/// `ferry daemon --fd-holder SOCKET` calls. Started by a daemon (in its own session, so
/// the daemon's terminal and process group do not reach it), SIGINT/SIGHUP are ignored;
/// it ends by being emptied. `persistent` (run on its own, by a service manager): it
/// never exits by itself. SIGTERM ends either kind, dropping what it holds: the kernel
/// then aborts those connections, so their mounts fail with ENOTCONN and can be
/// unmounted, instead of waiting for a daemon that is not coming back.
pub fn run_holder(socket: &Path, persistent: bool) -> Result<(), HolderError> {
    let ignored: &[Signal] = if persistent {
        &[Signal::SIGHUP]
    } else {
        &[Signal::SIGINT, Signal::SIGHUP]
    };
    for &sig in ignored {
        // SAFETY: setting a signal's disposition to ignore installs no handler, so it has
        // no preconditions; it fails only for signals that cannot be ignored.
        unsafe { signal(sig, SigHandler::SigIgn) }
            .map_err(|e| io_err(format!("ignoring {sig}"))(io::Error::from(e)))?;
    }
    // A live holder keeps its socket: replacing it would orphan what it holds.
    if connect(socket).is_ok() {
        return Err(HolderError::Refused(format!(
            "a holder already listens on {}",
            socket.display()
        )));
    }
    let listener = listen(socket).map_err(io_err(format!("listening on {}", socket.display())))?;
    tracing::info!(socket = %socket.display(), pid = std::process::id(), "fd holder serving");
    let result = Arc::new(Holder::new()).serve(listener, persistent);
    let _ = std::fs::remove_file(socket);
    tracing::info!("fd holder: nothing held and no daemon connected; exiting");
    result.map_err(io_err("serving"))
}

/// The daemon's end: one connection to the holder, requests serialized.
#[derive(Debug)]
pub struct FdHolderClient {
    sock: Mutex<OwnedFd>,
    socket_path: Option<PathBuf>,
}

impl FdHolderClient {
    /// A client over an already connected socket (tests use a socket pair).
    pub fn from_socket(sock: OwnedFd) -> Result<FdHolderClient, HolderError> {
        set_timeout(sock.as_fd(), CLIENT_TIMEOUT).map_err(io_err("setting socket timeouts"))?;
        Ok(FdHolderClient {
            sock: Mutex::new(sock),
            socket_path: None,
        })
    }

    /// Connects to the holder at `socket`.
    pub fn connect(socket: &Path) -> Result<FdHolderClient, HolderError> {
        let sock =
            connect(socket).map_err(io_err(format!("connecting to {}", socket.display())))?;
        let mut client = FdHolderClient::from_socket(sock)?;
        client.socket_path = Some(socket.to_path_buf());
        Ok(client)
    }

    /// Connects to the holder at `socket`, starting one with `spawn` when none listens
    /// (then waiting up to 5 s for it to listen).
    pub fn connect_or_spawn(
        socket: &Path,
        spawn: impl FnOnce() -> io::Result<()>,
    ) -> Result<FdHolderClient, HolderError> {
        if let Ok(c) = FdHolderClient::connect(socket) {
            return Ok(c);
        }
        spawn().map_err(io_err("starting the fd holder"))?;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            match FdHolderClient::connect(socket) {
                Ok(c) => return Ok(c),
                Err(e) if std::time::Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// The socket path this client connected to, if it connected by path.
    pub fn socket_path(&self) -> Option<&Path> {
        self.socket_path.as_deref()
    }

    fn recv_reply(sock: BorrowedFd<'_>) -> Result<(Reply, Option<OwnedFd>), HolderError> {
        let (bytes, fd) = recv_message(sock)
            .map_err(io_err("reading the fd holder's answer"))?
            .ok_or_else(|| HolderError::Protocol("the holder closed the connection".into()))?;
        let reply: Reply = serde_json::from_slice(&bytes)
            .map_err(|e| HolderError::Protocol(format!("bad answer: {e}")))?;
        if let Reply::Error { message } = reply {
            return Err(HolderError::Refused(message));
        }
        Ok((reply, fd))
    }

    /// Holds a copy of `fd` under `key` with `meta` (replacing an earlier one).
    pub fn put(&self, key: &str, meta: &str, fd: BorrowedFd<'_>) -> Result<(), HolderError> {
        if key.is_empty() || key.len() > MAX_KEY || meta.len() > MAX_META {
            return Err(HolderError::Refused("key or record too large".into()));
        }
        let sock = self.sock.lock();
        let request = Request::Put {
            key: key.to_owned(),
            meta: meta.to_owned(),
        };
        send_json(sock.as_fd(), &request, Some(fd)).map_err(io_err("sending to the fd holder"))?;
        match Self::recv_reply(sock.as_fd())? {
            (Reply::Ok, None) => Ok(()),
            (other, _) => Err(HolderError::Protocol(format!(
                "unexpected answer to put: {other:?}"
            ))),
        }
    }

    /// Closes what is held under `key`; true when something was.
    pub fn remove(&self, key: &str) -> Result<bool, HolderError> {
        let sock = self.sock.lock();
        let request = Request::Remove {
            key: key.to_owned(),
        };
        send_json(sock.as_fd(), &request, None).map_err(io_err("sending to the fd holder"))?;
        match Self::recv_reply(sock.as_fd())? {
            (Reply::Removed { existed }, None) => Ok(existed),
            (other, _) => Err(HolderError::Protocol(format!(
                "unexpected answer to remove: {other:?}"
            ))),
        }
    }

    /// Every held entry, each with a copy of its descriptor.
    pub fn get_all(&self) -> Result<Vec<HeldEntry>, HolderError> {
        let sock = self.sock.lock();
        send_json(sock.as_fd(), &Request::GetAll, None)
            .map_err(io_err("sending to the fd holder"))?;
        let mut out = Vec::new();
        loop {
            match Self::recv_reply(sock.as_fd())? {
                (Reply::Entry { key, meta }, Some(fd)) => {
                    if out.len() >= MAX_ENTRIES {
                        return Err(HolderError::Protocol("too many entries".into()));
                    }
                    out.push(HeldEntry { key, meta, fd });
                }
                (Reply::End, None) => return Ok(out),
                (other, _) => {
                    return Err(HolderError::Protocol(format!(
                        "unexpected answer to get_all: {other:?}"
                    )));
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::{Read, Seek, Write};

    use super::*;

    /// A holder serving one end of a socket pair on a thread; the client on the other.
    fn pair() -> (Arc<Holder>, FdHolderClient, std::thread::JoinHandle<()>) {
        let (a, b) = seqpacket_pair().unwrap();
        let holder = Arc::new(Holder::new());
        let h = holder.clone();
        let thread = std::thread::spawn(move || h.serve_client(b));
        (holder, FdHolderClient::from_socket(a).unwrap(), thread)
    }

    fn file_with(text: &str) -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    fn read_all(fd: OwnedFd) -> String {
        let mut f = std::fs::File::from(fd);
        f.rewind().unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn put_get_all_remove_round_trip_with_the_same_open_files() {
        let (holder, client, thread) = pair();
        let one = file_with("one");
        let two = file_with("two");
        client.put("/mnt/a", "meta-a", one.as_fd()).unwrap();
        client.put("/mnt/b", "meta-b", two.as_fd()).unwrap();
        drop((one, two));
        assert_eq!(holder.len(), 2);
        let all = client.get_all().unwrap();
        let got: Vec<(String, String)> = all
            .iter()
            .map(|e| (e.key.clone(), e.meta.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("/mnt/a".into(), "meta-a".into()),
                ("/mnt/b".into(), "meta-b".into())
            ]
        );
        // The descriptors are the very files put (their contents came through).
        let mut texts: Vec<String> = all.into_iter().map(|e| read_all(e.fd)).collect();
        texts.sort();
        assert_eq!(texts, vec!["one".to_owned(), "two".to_owned()]);
        // Replacing keeps one entry under the key, with the new record and file.
        client
            .put("/mnt/a", "meta-a2", file_with("three").as_fd())
            .unwrap();
        let all = client.get_all().unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].meta, "meta-a2");
        assert!(client.remove("/mnt/a").unwrap());
        assert!(!client.remove("/mnt/a").unwrap());
        assert_eq!(holder.len(), 1);
        drop(client);
        thread.join().unwrap();
        // Entries outlive the client: the next daemon gets them.
        assert_eq!(holder.len(), 1);
    }

    #[test]
    fn entries_survive_a_client_that_dies_and_a_new_client_gets_them() {
        let (a, b) = seqpacket_pair().unwrap();
        let holder = Arc::new(Holder::new());
        let h = holder.clone();
        let t = std::thread::spawn(move || h.serve_client(b));
        let client = FdHolderClient::from_socket(a).unwrap();
        client
            .put("/k", "{\"x\":1}", file_with("kept").as_fd())
            .unwrap();
        drop(client);
        t.join().unwrap();
        let (a, b) = seqpacket_pair().unwrap();
        let h = holder.clone();
        let t = std::thread::spawn(move || h.serve_client(b));
        let client = FdHolderClient::from_socket(a).unwrap();
        let all = client.get_all().unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].meta, "{\"x\":1}");
        assert_eq!(read_all(all.into_iter().next().unwrap().fd), "kept");
        drop(client);
        t.join().unwrap();
    }

    #[test]
    fn protocol_violations_are_refused_or_end_the_connection() {
        let (a, b) = seqpacket_pair().unwrap();
        let holder = Arc::new(Holder::new());
        let h = holder.clone();
        let t = std::thread::spawn(move || h.serve_client(b));
        // put without a descriptor: refused, connection stays usable.
        send_json(
            a.as_fd(),
            &Request::Put {
                key: "/k".into(),
                meta: String::new(),
            },
            None,
        )
        .unwrap();
        let (bytes, fd) = recv_message(a.as_fd()).unwrap().unwrap();
        assert!(fd.is_none());
        assert!(matches!(
            serde_json::from_slice(&bytes).unwrap(),
            Reply::Error { .. }
        ));
        // An over-long key: refused by the holder too (the client checks first).
        let long = "k".repeat(MAX_KEY + 1);
        let f = file_with("x");
        send_json(
            a.as_fd(),
            &Request::Put {
                key: long,
                meta: String::new(),
            },
            Some(f.as_fd()),
        )
        .unwrap();
        let (bytes, _) = recv_message(a.as_fd()).unwrap().unwrap();
        assert!(matches!(
            serde_json::from_slice(&bytes).unwrap(),
            Reply::Error { .. }
        ));
        assert!(holder.is_empty());
        // Garbage ends the connection.
        send_message(a.as_fd(), b"not json", None).unwrap();
        assert!(recv_message(a.as_fd()).unwrap().is_none());
        t.join().unwrap();
        assert!(holder.is_empty());
    }

    #[test]
    fn a_message_with_two_descriptors_is_rejected() {
        let (a, b) = seqpacket_pair().unwrap();
        let f1 = file_with("1");
        let f2 = file_with("2");
        // Hand-build one message with two descriptors.
        let raw = [f1.as_raw_fd(), f2.as_raw_fd()];
        let body = b"{}";
        let sent = socket::sendmsg::<()>(
            a.as_raw_fd(),
            &[IoSlice::new(body)],
            &[ControlMessage::ScmRights(&raw)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        assert!(sent > 0);
        let err = recv_message(b.as_fd()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn the_holder_listens_serves_and_exits_once_idle_and_empty() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fdstore.sock");
        let listener = listen(&socket).unwrap();
        let holder = Arc::new(Holder::new());
        let h = holder.clone();
        let server = std::thread::spawn(move || h.serve(listener, false));
        let client = FdHolderClient::connect(&socket).unwrap();
        assert_eq!(client.socket_path(), Some(socket.as_path()));
        client.put("/m", "r", file_with("held").as_fd()).unwrap();
        drop(client);
        // Holding something: it keeps serving; a second client sees the entry.
        std::thread::sleep(IDLE_CHECK * 2);
        assert!(!server.is_finished());
        let client = FdHolderClient::connect(&socket).unwrap();
        assert_eq!(client.get_all().unwrap().len(), 1);
        assert!(client.remove("/m").unwrap());
        drop(client);
        // Empty and nobody connected: it returns.
        server.join().unwrap().unwrap();
        assert!(holder.is_empty());
    }

    #[test]
    fn connect_or_spawn_starts_a_holder_only_when_none_listens() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("h.sock");
        let started = Arc::new(AtomicUsize::new(0));
        let spawn = |socket: PathBuf, started: Arc<AtomicUsize>| {
            move || {
                started.fetch_add(1, Ordering::SeqCst);
                let listener = listen(&socket)?;
                std::thread::spawn(move || Arc::new(Holder::new()).serve(listener, false));
                Ok(())
            }
        };
        let c1 = FdHolderClient::connect_or_spawn(&socket, spawn(socket.clone(), started.clone()))
            .unwrap();
        c1.put("/x", "", file_with("x").as_fd()).unwrap();
        let c2 = FdHolderClient::connect_or_spawn(&socket, spawn(socket.clone(), started.clone()))
            .unwrap();
        assert_eq!(started.load(Ordering::SeqCst), 1);
        assert_eq!(c2.get_all().unwrap().len(), 1);
        assert!(c2.remove("/x").unwrap());
    }

    #[test]
    fn descriptors_whose_other_end_is_gone_are_pruned() {
        let (a, b) = seqpacket_pair().unwrap();
        let holder = Arc::new(Holder::new());
        let h = holder.clone();
        let t = std::thread::spawn(move || h.serve_client(b));
        let client = FdHolderClient::from_socket(a).unwrap();
        // Stand-ins for FUSE connections: socket pairs whose peer we keep or drop.
        let (live, live_peer) = seqpacket_pair().unwrap();
        let (dead, dead_peer) = seqpacket_pair().unwrap();
        client.put("/live", "", live.as_fd()).unwrap();
        client.put("/dead", "", dead.as_fd()).unwrap();
        drop((live, dead));
        assert_eq!(holder.prune_dead(), 0);
        drop(dead_peer);
        assert_eq!(holder.prune_dead(), 1);
        let keys: Vec<String> = client
            .get_all()
            .unwrap()
            .into_iter()
            .map(|e| e.key)
            .collect();
        assert_eq!(keys, vec!["/live".to_owned()]);
        drop(live_peer);
        drop(client);
        t.join().unwrap();
    }

    #[test]
    fn socket_paths_are_checked() {
        assert!(sockaddr(Path::new("")).is_err());
        assert!(sockaddr(&PathBuf::from("/".repeat(200))).is_err());
        assert!(sockaddr(Path::new("/run/ferry/fdstore.sock")).is_ok());
    }
}
