//! Tests of trace lookup order, sharing, the stop rule (with an injectable clock) and
//! the node trace store, with an in-memory registry side.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};

use ferry_fs::TraceRead;
use ferry_registry_client::ClientError;

use super::*;

const IMAGE_V1: &str = "reg.local:5000/team/app:v1";
const IMAGE_V2: &str = "reg.local:5000/team/app:v2";

fn manifest(c: char) -> String {
    format!("sha256:{}", c.to_string().repeat(64))
}

fn trace(path: &str, len: u64) -> Trace {
    Trace {
        reads: vec![TraceRead {
            path: path.into(),
            offset: 0,
            len,
        }],
    }
}

/// What an in-memory registry does with pushes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Push {
    Allowed,
    Refused(u16),
    Broken,
}

/// An in-memory registry: referrers per manifest, one repository-newest slot, and the
/// pull-only endpoint.
struct MemRemote {
    push: Push,
    endpoint: bool,
    published: Mutex<HashMap<String, Trace>>,
    newest: Mutex<Option<(String, Trace)>>,
    sent: Mutex<Vec<String>>,
    broken_lookups: bool,
}

impl MemRemote {
    fn new(push: Push, endpoint: bool) -> MemRemote {
        MemRemote {
            push,
            endpoint,
            published: Mutex::default(),
            newest: Mutex::default(),
            sent: Mutex::default(),
            broken_lookups: false,
        }
    }
}

fn refused(status: u16) -> Error {
    let (registry, message) = ("reg.local:5000".to_owned(), "no".to_owned());
    Error::Registry(match status {
        401 => ClientError::Unauthorized { registry, message },
        403 => ClientError::Denied { registry, message },
        s => ClientError::Status {
            registry,
            method: "PUT".into(),
            path: "/v2/x".into(),
            status: s,
            message,
        },
    })
}

impl RemoteTraces for MemRemote {
    fn published(&self, _image: &str, manifest: &str) -> Result<Option<Trace>> {
        if self.broken_lookups {
            return Err(Error::Control("registry down".into()));
        }
        Ok(self.published.lock().unwrap().get(manifest).cloned())
    }
    fn repository_newest(&self, _image: &str) -> Result<Option<(String, Trace)>> {
        if self.broken_lookups {
            return Err(Error::Control("registry down".into()));
        }
        Ok(self.newest.lock().unwrap().clone())
    }
    fn publish(&self, _image: &str, manifest: &str, trace: &Trace) -> Result<String> {
        match self.push {
            Push::Allowed => {
                self.published
                    .lock()
                    .unwrap()
                    .insert(manifest.into(), trace.clone());
                *self.newest.lock().unwrap() = Some((manifest.into(), trace.clone()));
                Ok("sha256:pushed".into())
            }
            Push::Refused(s) => Err(refused(s)),
            Push::Broken => Err(refused(502)),
        }
    }
    fn send(&self, _image: &str, manifest: &str, trace: &Trace) -> Result<String> {
        if !self.endpoint {
            return Err(refused(404));
        }
        self.sent.lock().unwrap().push(manifest.into());
        self.published
            .lock()
            .unwrap()
            .insert(manifest.into(), trace.clone());
        *self.newest.lock().unwrap() = Some((manifest.into(), trace.clone()));
        Ok("sha256:accepted".into())
    }
}

fn node_store(dir: &Path) -> NodeTraces {
    NodeTraces::open(&dir.join("traces"), 8, 1 << 20).unwrap()
}

#[test]
fn lookup_prefers_published_then_node_then_previous_versions() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_store(dir.path());
    let remote = MemRemote::new(Push::Allowed, false);
    let (m1, m2) = (manifest('1'), manifest('2'));
    assert_eq!(lookup(&remote, Some(&node), IMAGE_V2, &m2), None);

    // Only the registry's repository trace, of v1: the previous version's.
    *remote.newest.lock().unwrap() = Some((m1.clone(), trace("/reg-v1", 10)));
    let f = lookup(&remote, Some(&node), IMAGE_V2, &m2).unwrap();
    assert_eq!(f.info.source, TraceSource::PreviousVersion);
    assert_eq!(
        (f.info.recorded_for.as_str(), f.info.reads),
        (m1.as_str(), 1)
    );
    assert_eq!(f.trace, trace("/reg-v1", 10));

    // The node's trace of v1 comes before the registry's repository trace.
    node.save(
        &repository_of(IMAGE_V1).unwrap(),
        &m1,
        &trace("/node-v1", 20),
    )
    .unwrap();
    let f = lookup(&remote, Some(&node), IMAGE_V2, &m2).unwrap();
    assert_eq!(f.info.source, TraceSource::PreviousVersion);
    assert_eq!(f.trace, trace("/node-v1", 20));
    assert_eq!(f.info.bytes, 20);

    // The node's own trace of v2 comes before any other version's.
    node.save(
        &repository_of(IMAGE_V2).unwrap(),
        &m2,
        &trace("/node-v2", 30),
    )
    .unwrap();
    let f = lookup(&remote, Some(&node), IMAGE_V2, &m2).unwrap();
    assert_eq!(
        (f.info.source, f.trace),
        (TraceSource::Node, trace("/node-v2", 30))
    );

    // A published trace of v2 comes first.
    remote
        .published
        .lock()
        .unwrap()
        .insert(m2.clone(), trace("/pub-v2", 40));
    let f = lookup(&remote, Some(&node), IMAGE_V2, &m2).unwrap();
    assert_eq!(
        (f.info.source, f.trace),
        (TraceSource::Published, trace("/pub-v2", 40))
    );
}

#[test]
fn lookup_survives_a_broken_registry_and_knows_the_repository_tag_may_be_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_store(dir.path());
    let m1 = manifest('1');
    let mut remote = MemRemote::new(Push::Allowed, false);
    remote.broken_lookups = true;
    assert_eq!(lookup(&remote, Some(&node), IMAGE_V1, &m1), None);
    node.save(&repository_of(IMAGE_V1).unwrap(), &m1, &trace("/n", 1))
        .unwrap();
    let f = lookup(&remote, Some(&node), IMAGE_V1, &m1).unwrap();
    assert_eq!(f.info.source, TraceSource::Node);
    // The repository's newest trace is of this very manifest: its own, not another
    // version's (so it is not recorded again).
    let remote = MemRemote::new(Push::Allowed, false);
    *remote.newest.lock().unwrap() = Some((m1.clone(), trace("/r", 1)));
    let f = lookup(&remote, None, IMAGE_V1, &m1).unwrap();
    assert_eq!(f.info.source, TraceSource::Published);
}

#[test]
fn sharing_pushes_then_falls_back_to_the_endpoint_and_always_keeps_a_node_copy() {
    let (m1, m2) = (manifest('1'), manifest('2'));
    let t = trace("/bin/sh", 4096);
    for (push, endpoint, want) in [
        (
            Push::Allowed,
            true,
            Shared::Referrer("sha256:pushed".into()),
        ),
        (
            Push::Refused(401),
            true,
            Shared::RegistryEndpoint("sha256:accepted".into()),
        ),
        (
            Push::Refused(403),
            true,
            Shared::RegistryEndpoint("sha256:accepted".into()),
        ),
        (
            Push::Refused(405),
            true,
            Shared::RegistryEndpoint("sha256:accepted".into()),
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let node = node_store(dir.path());
        let remote = MemRemote::new(push, endpoint);
        assert_eq!(share(&remote, Some(&node), IMAGE_V1, &m1, &t), want);
        assert_eq!(node.for_manifest(&m1).unwrap(), Some(t.clone()));
        // Another node (no node store) finds it published for the manifest, and a new
        // tag finds it as the previous version's.
        let f = lookup(&remote, None, IMAGE_V1, &m1).unwrap();
        assert_eq!(f.info.source, TraceSource::Published);
        let f = lookup(&remote, None, IMAGE_V2, &m2).unwrap();
        assert_eq!(f.info.source, TraceSource::PreviousVersion);
        assert_eq!(f.trace, t);
    }
    // Refused and no endpoint (not ferry's registry), or a failing registry (no
    // fallback for what is not a refusal): kept on the node only.
    for (push, endpoint) in [(Push::Refused(403), false), (Push::Broken, true)] {
        let dir = tempfile::tempdir().unwrap();
        let node = node_store(dir.path());
        let remote = MemRemote::new(push, endpoint);
        assert!(matches!(
            share(&remote, Some(&node), IMAGE_V1, &m1, &t),
            Shared::NodeOnly(_)
        ));
        assert!(remote.sent.lock().unwrap().is_empty());
        assert_eq!(node.for_manifest(&m1).unwrap(), Some(t.clone()));
    }
    // A layout image is never written to.
    let dir = tempfile::tempdir().unwrap();
    let node = node_store(dir.path());
    let remote = MemRemote::new(Push::Allowed, true);
    assert!(matches!(
        share(&remote, Some(&node), "oci:/tmp/layout:v1", &m1, &t),
        Shared::NodeOnly(_)
    ));
    assert!(remote.published.lock().unwrap().is_empty());
    assert_eq!(node.for_manifest(&m1).unwrap(), Some(t));
}

/// A clock that only moves when slept on, running `on_sleep` (the "workload") first.
struct FakeClock {
    now: Mutex<Instant>,
    on_sleep: Box<dyn Fn(Duration) + Send + Sync>,
    start: Instant,
}

impl FakeClock {
    fn new(on_sleep: impl Fn(Duration) + Send + Sync + 'static) -> FakeClock {
        let start = Instant::now();
        FakeClock {
            now: Mutex::new(start),
            on_sleep: Box::new(on_sleep),
            start,
        }
    }
    fn elapsed(&self) -> Duration {
        *self.now.lock().unwrap() - self.start
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Instant {
        *self.now.lock().unwrap()
    }
    fn sleep(&self, d: Duration) {
        let at = {
            let mut now = self.now.lock().unwrap();
            *now += d;
            *now - self.start
        };
        (self.on_sleep)(at);
    }
}

/// An inode tree with one file `/f` of 1 MiB.
fn one_file_tree() -> (ferry_fs::InodeTree, u64) {
    let mut tar = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_size(1 << 20);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    tar.append_data(&mut h, "f", &vec![0u8; 1 << 20][..])
        .unwrap();
    let tar = tar.into_inner().unwrap();
    let source = Arc::new(ferry_index::source::MemSource(tar));
    let layer =
        ferry_index::reader::LayerReader::whole(source, ferry_oci::media::LayerCompression::None)
            .unwrap();
    let tree = ferry_fs::InodeTree::merged(&ferry_index::merged::MergedImage::new(vec![layer]));
    let ino = tree.resolve("/f").unwrap();
    (tree, ino)
}

const RULE: StopRule = StopRule {
    quiet: Duration::from_secs(3),
    max_duration: Duration::from_secs(60),
};

#[test]
fn recording_waits_for_the_first_read_and_stops_when_reads_go_quiet() {
    let (tree, ino) = one_file_tree();
    let recorder = Arc::new(Recorder::default());
    recorder.start_passive();
    let r = recorder.clone();
    // Nothing for 10 s (the container is not started yet), then a new piece every
    // second until 15 s, then re-reads only (not new first touches).
    let clock = FakeClock::new(move |at| {
        let s = at.as_millis() as u64 / 1000;
        if (10..=15).contains(&s) {
            r.note(1, &tree, ino, s * 4096, 4096);
        } else if s > 15 {
            r.note(1, &tree, ino, 10 * 4096, 4096);
        }
    });
    let reason = watch(&recorder, &RULE, &clock, &|| true);
    assert_eq!(reason, StopReason::Quiet);
    // The last new touch was at 15 s (seen at 15.0–15.2 s): quiet 3 s later.
    let t = clock.elapsed();
    assert!(
        t >= Duration::from_secs(18) && t <= Duration::from_millis(18_400),
        "{t:?}"
    );
    assert!(recorder.is_recording(), "watch decides; the caller takes");
    assert_eq!(recorder.take().reads.len(), 1, "one growing piece of /f");
}

#[test]
fn recording_stops_at_the_maximum_duration_however_busy() {
    let (tree, ino) = one_file_tree();
    let recorder = Arc::new(Recorder::default());
    recorder.start_passive();
    let r = recorder.clone();
    // A new first touch at every tick, from 1 s on, forever.
    let clock = FakeClock::new(move |at| {
        let tick = at.as_millis() as u64 / 200;
        if tick >= 5 {
            // One byte, a gap of one: never touching an earlier read.
            r.note(1, &tree, ino, tick * 2, 1);
        }
    });
    assert_eq!(
        watch(&recorder, &RULE, &clock, &|| true),
        StopReason::MaxDuration
    );
    let t = clock.elapsed();
    assert!(
        t >= Duration::from_secs(61) && t <= Duration::from_millis(61_400),
        "{t:?}"
    );
}

#[test]
fn recording_ends_when_its_mounts_go_or_someone_stops_it() {
    let recorder = Recorder::default();
    recorder.start_passive();
    let clock = FakeClock::new(|_| {});
    let alive = Mutex::new(3);
    let reason = watch(&recorder, &RULE, &clock, &|| {
        let mut n = alive.lock().unwrap();
        *n -= 1;
        *n > 0
    });
    assert_eq!(reason, StopReason::Unmounted);
    recorder.take();
    assert_eq!(
        watch(&recorder, &RULE, &clock, &|| true),
        StopReason::Cancelled
    );
}

#[test]
fn manifest_digests_go_through_the_digest_parser() {
    let lower = manifest('a');
    assert_eq!(manifest_hex(&lower).unwrap(), &lower["sha256:".len()..]);
    // Uppercase hex is no sha256 digest: refused here as by ferry-oci everywhere else.
    assert!(manifest_hex(&format!("sha256:{}", "A".repeat(64))).is_err());
    assert!(manifest_hex(&format!("sha256:{}", "a".repeat(63))).is_err());
    assert!(manifest_hex(&format!("sha512:{}", "a".repeat(128))).is_err());
    assert!(manifest_hex("a".repeat(64).as_str()).is_err());
}

#[test]
fn stop_rule_needs_a_first_read() {
    let now = Instant::now();
    assert_eq!(
        RULE.check(now + Duration::from_secs(3600), None, None),
        None
    );
    let first = Some(now);
    assert_eq!(RULE.check(now + Duration::from_secs(2), first, first), None);
    assert_eq!(
        RULE.check(now + Duration::from_secs(3), first, first),
        Some(StopReason::Quiet)
    );
    let latest = Some(now + Duration::from_secs(59));
    assert_eq!(
        RULE.check(now + Duration::from_secs(60), first, latest),
        Some(StopReason::MaxDuration)
    );
}

#[test]
fn node_store_is_private_bounded_and_indexed_by_repository() {
    let dir = tempfile::tempdir().unwrap();
    let traces_dir = dir.path().join("traces");
    // A directory that exists with a looser mode is tightened.
    std::fs::create_dir(&traces_dir).unwrap();
    std::fs::set_permissions(&traces_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let node = NodeTraces::open(&traces_dir, 3, 1 << 20).unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&traces_dir), 0o700);
    let repo = repository_of(IMAGE_V1).unwrap();
    assert_eq!(repo, "reg.local:5000/team/app");
    let other = repository_of("reg.local:5000/other:v1").unwrap();

    node.save(&repo, &manifest('1'), &trace("/a", 1)).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    node.save(&other, &manifest('2'), &trace("/b", 1)).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    node.save(&repo, &manifest('3'), &trace("/c", 1)).unwrap();
    for entry in std::fs::read_dir(&traces_dir).unwrap() {
        assert_eq!(mode(&entry.unwrap().path()), 0o600);
    }
    // Newest of the repository, this manifest excluded; the other repository apart.
    let (m, t) = node.newest_of(&repo, &manifest('9')).unwrap().unwrap();
    assert_eq!((m, t), (manifest('3'), trace("/c", 1)));
    let (m, _) = node.newest_of(&repo, &manifest('3')).unwrap().unwrap();
    assert_eq!(m, manifest('1'));
    let (m, _) = node.newest_of(&other, &manifest('9')).unwrap().unwrap();
    assert_eq!(m, manifest('2'));
    assert_eq!(
        node.newest_of("reg.local:5000/none", &manifest('9'))
            .unwrap(),
        None
    );

    // A fourth trace evicts the oldest (count bound).
    std::thread::sleep(Duration::from_millis(20));
    node.save(&repo, &manifest('4'), &trace("/d", 1)).unwrap();
    assert_eq!(node.for_manifest(&manifest('1')).unwrap(), None);
    assert!(node.for_manifest(&manifest('2')).unwrap().is_some());
    // Saving a manifest again replaces its trace.
    node.save(&repo, &manifest('4'), &trace("/e", 2)).unwrap();
    assert_eq!(
        node.for_manifest(&manifest('4')).unwrap(),
        Some(trace("/e", 2))
    );
    assert_eq!(std::fs::read_dir(&traces_dir).unwrap().count(), 3);

    // The byte bound: a store of 1 MiB keeps what fits, newest first, and refuses a
    // trace that could never fit.
    let small = NodeTraces::open(&dir.path().join("small"), 100, 1 << 20).unwrap();
    let big = |c: char| Trace {
        reads: (0..6000)
            .map(|i| TraceRead {
                path: format!("/{}/{i:06}", c.to_string().repeat(40)),
                offset: 0,
                len: 1,
            })
            .collect(),
    };
    let size = big('a').to_json().unwrap().len() as u64;
    assert!(size > (1 << 20) / 3 && size < (1 << 20) / 2, "{size}");
    for c in ['a', 'b', 'c'] {
        small.save(&repo, &manifest(c), &big(c)).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(small.for_manifest(&manifest('a')).unwrap(), None);
    assert!(small.for_manifest(&manifest('c')).unwrap().is_some());
    let huge = Trace {
        reads: (0..30_000)
            .map(|i| TraceRead {
                path: format!("/{}/{i:06}", "h".repeat(40)),
                offset: 0,
                len: 1,
            })
            .collect(),
    };
    assert!(small.save(&repo, &manifest('d'), &huge).is_err());

    // Garbage and links are not traces.
    std::fs::write(
        traces_dir.join(format!("{}-{}.trace.json", "0".repeat(16), "5".repeat(64))),
        b"not json",
    )
    .unwrap();
    assert!(node.for_manifest(&manifest('5')).is_err());
    assert!(node.for_manifest("sha256:short").is_err());
}
