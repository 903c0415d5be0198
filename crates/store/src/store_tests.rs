//! Tests of the chunk store: the put/get contract, eviction and pins, restarts and crash
//! leftovers, concurrency, and a random-operation comparison against a model.

#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::io::{Seek, SeekFrom};
use std::sync::Barrier;

use proptest::prelude::*;
use redb::ReadableDatabase;

use super::*;
use crate::clock::ManualClock;

const T0: u64 = 1_700_000_000_000;

fn options(max: u64, clock: &Arc<ManualClock>) -> StoreOptions {
    StoreOptions {
        max_bytes: Some(max),
        pin_grace: Duration::from_secs(60),
        flush_interval: None,
        clock: Arc::clone(clock) as Arc<dyn Clock>,
        seed: None,
    }
}

fn open(dir: &Path, max: u64) -> (Store, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(T0));
    let store = Store::open_with(dir, options(max, &clock)).unwrap();
    (store, clock)
}

fn chunk(seed: u8, size: usize) -> (ChunkKey, Vec<u8>) {
    let bytes: Vec<u8> = (0..size)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    (ChunkKey::of(&bytes), bytes)
}

fn chunk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in fs::read_dir(dir.join("chunks")).unwrap() {
        for f in fs::read_dir(sub.unwrap().path()).unwrap() {
            out.push(f.unwrap().path());
        }
    }
    out
}

fn temp_files(dir: &Path) -> usize {
    fs::read_dir(dir.join("tmp")).unwrap().count()
}

fn keys_lru_first(store: &Store) -> Vec<ChunkKey> {
    store.list().into_iter().map(|e| e.key).collect()
}

fn flip_first_byte(path: &Path) {
    let mut f = File::options().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact(&mut b).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(&[b[0] ^ 0xff]).unwrap();
}

#[test]
fn put_then_get_and_open_return_the_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1 << 20);
    let (k, bytes) = chunk(1, 5000);
    assert_eq!(store.put(&k, &bytes).unwrap(), PutOutcome::Stored);
    assert!(store.contains(&k));
    assert_eq!(store.get(&k).unwrap().unwrap(), bytes);
    let f = store.open_chunk(&k).unwrap().unwrap();
    assert_eq!(f.len(), 5000);
    let mut buf = vec![0u8; 100];
    assert_eq!(f.read_at(&mut buf, 4950).unwrap(), 50);
    assert_eq!(&buf[..50], &bytes[4950..]);
    assert_eq!(fs::read(f.path()).unwrap(), bytes);
    let (absent, _) = chunk(2, 10);
    assert!(store.get(&absent).unwrap().is_none());
    assert!(store.open_chunk(&absent).unwrap().is_none());
    let s = store.stats();
    assert_eq!(
        (s.entries, s.bytes, s.hits, s.misses, s.inserts),
        (1, 5000, 2, 2, 1)
    );
    assert_eq!(temp_files(dir.path()), 0);
    store.inner.check_invariants();
}

#[test]
fn empty_chunk_is_a_valid_entry() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 100);
    let k = ChunkKey::of(b"");
    store.put(&k, b"").unwrap();
    assert_eq!(store.get(&k).unwrap().unwrap(), Vec::<u8>::new());
    drop(store);
    let (store, _) = open(dir.path(), 100);
    assert_eq!(store.get(&k).unwrap().unwrap(), Vec::<u8>::new());
    assert!(store.open_chunk(&k).unwrap().unwrap().is_empty());
}

#[test]
fn mismatched_bytes_are_refused_and_nothing_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1 << 20);
    let (k, _) = chunk(1, 100);
    let (_, other) = chunk(2, 100);
    match store.put(&k, &other) {
        Err(Error::DigestMismatch { expected, actual }) => {
            assert_eq!(expected, k);
            assert_eq!(actual, ChunkKey::of(&other));
        }
        r => panic!("expected a mismatch, got {r:?}"),
    }
    let mut reader: &[u8] = &other;
    assert!(matches!(
        store.put_reader(&k, &mut reader),
        Err(Error::DigestMismatch { .. })
    ));
    assert!(!store.contains(&k));
    assert!(chunk_files(dir.path()).is_empty());
    assert_eq!(temp_files(dir.path()), 0);
    assert_eq!(store.stats().rejected_puts, 2);
    assert_eq!(store.stats().bytes, 0);
}

#[test]
fn put_of_a_present_key_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1 << 20);
    let (k, bytes) = chunk(1, 100);
    assert_eq!(store.put(&k, &bytes).unwrap(), PutOutcome::Stored);
    assert_eq!(store.put(&k, &bytes).unwrap(), PutOutcome::AlreadyPresent);
    let mut reader: &[u8] = &bytes;
    assert_eq!(
        store.put_reader(&k, &mut reader).unwrap(),
        PutOutcome::AlreadyPresent
    );
    assert_eq!(chunk_files(dir.path()).len(), 1);
    assert_eq!(store.stats().inserts, 1);
}

#[test]
fn put_reader_streams_and_bounds_the_size() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 3 << 20);
    let (k, bytes) = chunk(3, (2 << 20) + 17);
    let mut reader: &[u8] = &bytes;
    assert_eq!(
        store.put_reader(&k, &mut reader).unwrap(),
        PutOutcome::Stored
    );
    assert_eq!(store.get(&k).unwrap().unwrap(), bytes);
    let (big, big_bytes) = chunk(4, (3 << 20) + 1);
    let mut reader: &[u8] = &big_bytes;
    assert!(matches!(
        store.put_reader(&big, &mut reader),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        store.put(&big, &big_bytes),
        Err(Error::TooLarge { .. })
    ));
    assert_eq!(temp_files(dir.path()), 0);
    assert_eq!(chunk_files(dir.path()).len(), 1);
}

#[test]
fn eviction_takes_the_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 300);
    let (a, ab) = chunk(1, 100);
    let (b, bb) = chunk(2, 100);
    let (c, cb) = chunk(3, 100);
    let (d, db) = chunk(4, 100);
    let (e, eb) = chunk(5, 150);
    for (k, v) in [(&a, &ab), (&b, &bb), (&c, &cb)] {
        store.put(k, v).unwrap();
    }
    assert!(store.get(&a).unwrap().is_some());
    assert_eq!(keys_lru_first(&store), vec![b, c, a]);
    store.put(&d, &db).unwrap();
    assert!(!store.contains(&b));
    assert_eq!(keys_lru_first(&store), vec![c, a, d]);
    // A put of a present key counts as a use.
    store.put(&c, &cb).unwrap();
    store.put(&e, &eb).unwrap();
    assert_eq!(keys_lru_first(&store), vec![c, e]);
    assert!(!store.contains(&b) && !store.contains(&a) && !store.contains(&d));
    let s = store.stats();
    assert_eq!((s.evictions, s.bytes), (3, 250));
    assert_eq!(chunk_files(dir.path()).len(), 2);
    store.inner.check_invariants();
}

#[test]
fn pinned_entries_are_never_evicted() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 300);
    let (a, ab) = chunk(1, 100);
    let (b, bb) = chunk(2, 100);
    let (c, cb) = chunk(3, 100);
    let (d, db) = chunk(4, 100);
    let (e, eb) = chunk(5, 100);
    store.put(&a, &ab).unwrap();
    store.put(&b, &bb).unwrap();
    store.put(&c, &cb).unwrap();
    store.pin("mount-1", &[a, b]).unwrap();
    store.put(&d, &db).unwrap();
    assert!(store.contains(&a) && store.contains(&b) && !store.contains(&c));
    store.pin("mount-2", &[d]).unwrap();
    match store.put(&e, &eb) {
        Err(Error::Full {
            needed,
            max_bytes,
            pinned_bytes,
        }) => assert_eq!((needed, max_bytes, pinned_bytes), (100, 300, 300)),
        r => panic!("expected full, got {r:?}"),
    }
    assert!(!store.contains(&e));
    assert_eq!(temp_files(dir.path()), 0);
    assert_eq!(store.gc_to(0).unwrap().evicted_entries, 0);
    assert_eq!(store.unpin_owner("mount-1").unwrap(), 2);
    store.put(&e, &eb).unwrap();
    // a was used before b, so it goes first; d stays pinned.
    assert!(!store.contains(&a) && store.contains(&b) && store.contains(&d));
    store.inner.check_invariants();
}

#[test]
fn a_key_pinned_before_it_is_stored_is_protected_once_stored() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 200);
    let (a, ab) = chunk(1, 100);
    let (b, bb) = chunk(2, 100);
    let (c, cb) = chunk(3, 100);
    store.pin("m", &[a]).unwrap();
    // Pinned but not stored yet: the owner pins one key holding no bytes.
    let m = &store.owners()[0];
    assert_eq!((m.owner.as_str(), m.keys, m.bytes), ("m", 1, 0));
    store.put(&a, &ab).unwrap();
    assert_eq!(store.owners()[0].bytes, 100);
    store.put(&b, &bb).unwrap();
    store.put(&c, &cb).unwrap();
    assert!(store.contains(&a) && !store.contains(&b) && store.contains(&c));
    // Two owners pin one key: it stays pinned until both let go.
    store.pin("n", &[a, b]).unwrap();
    let owners: Vec<(String, u64, u64)> = store
        .owners()
        .into_iter()
        .map(|o| (o.owner, o.keys, o.bytes))
        .collect();
    assert_eq!(
        owners,
        vec![("m".into(), 1, 100), ("n".into(), 2, 100)],
        "b was evicted before n pinned it: it counts no bytes"
    );
    store.unpin_owner("m").unwrap();
    assert_eq!(store.gc_to(0).unwrap().pinned_bytes, 100);
    assert!(store.contains(&a));
    store.unpin_owner("n").unwrap();
    store.gc_to(0).unwrap();
    assert!(!store.contains(&a));
    assert!(matches!(store.pin("", &[a]), Err(Error::InvalidOwner(_))));
    let long = "x".repeat(crate::MAX_OWNER_LEN + 1);
    assert!(matches!(
        store.pin(&long, &[a]),
        Err(Error::InvalidOwner(_))
    ));
    store.inner.check_invariants();
}

#[test]
fn gc_evicts_unpinned_down_to_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 10_000);
    let chunks: Vec<_> = (0..10).map(|i| chunk(i, 100)).collect();
    for (k, v) in &chunks {
        store.put(k, v).unwrap();
    }
    store.pin("m", &[chunks[0].0]).unwrap();
    let r = store.gc_to(450).unwrap();
    assert_eq!(
        (r.evicted_entries, r.freed_bytes, r.bytes, r.pinned_bytes),
        (6, 600, 400, 100)
    );
    assert!(store.contains(&chunks[0].0));
    for (k, _) in &chunks[1..7] {
        assert!(!store.contains(k));
    }
    assert_eq!(chunk_files(dir.path()).len(), 4);
}

#[test]
fn bound_holds_after_every_put_with_mixed_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let max = 5000;
    let (store, _) = open(dir.path(), max);
    for i in 0..200u32 {
        let (k, v) = chunk((i % 251) as u8, 1 + (i as usize * 397) % 1800);
        store.put(&k, &v).unwrap();
        let s = store.stats();
        assert!(s.bytes <= max, "{} > {max} after put {i}", s.bytes);
        assert!(store.contains(&k));
    }
    let on_disk: u64 = chunk_files(dir.path())
        .iter()
        .map(|p| fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(on_disk, store.stats().bytes);
    store.inner.check_invariants();
}

#[test]
fn restart_keeps_entries_order_and_bound() {
    let dir = tempfile::tempdir().unwrap();
    let (store, clock) = open(dir.path(), 1000);
    let chunks: Vec<_> = (0..4).map(|i| chunk(i, 100)).collect();
    for (k, v) in &chunks {
        clock.advance(Duration::from_secs(1));
        store.put(k, v).unwrap();
    }
    clock.advance(Duration::from_secs(1));
    store.get(&chunks[0].0).unwrap();
    let order = keys_lru_first(&store);
    assert_eq!(order[3], chunks[0].0);
    drop(store);

    // Reopened with no bound given: keeps the persisted one.
    let clock = Arc::new(ManualClock::new(T0));
    let store = Store::open_with(
        dir.path(),
        StoreOptions {
            max_bytes: None,
            ..options(0, &clock)
        },
    )
    .unwrap();
    assert_eq!(store.max_bytes(), 1000);
    assert_eq!(store.open_report().entries, 4);
    assert_eq!(keys_lru_first(&store), order);
    let info = store.list();
    assert_eq!(info[3].last_access_ms, T0 + 5000);
    for (k, v) in &chunks {
        assert_eq!(store.get(k).unwrap().as_ref(), Some(v));
    }
    assert_eq!(store.stats().verification_failures, 0);
    drop(store);

    // Reopened with a smaller bound: evicts the least recent down to it.
    let (store, _) = open(dir.path(), 250);
    assert_eq!(store.open_report().evicted_at_open, 2);
    assert_eq!(store.stats().bytes, 200);
    assert_eq!(chunk_files(dir.path()).len(), 2);
}

#[test]
fn a_second_open_of_the_same_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, clock) = open(dir.path(), 1000);
    match Store::open_with(dir.path(), options(1000, &clock)) {
        Err(Error::InUse { path }) => assert_eq!(path, dir.path()),
        r => panic!("expected in use, got {r:?}"),
    }
}

#[test]
fn leftover_temp_files_are_removed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    store.put(&k, &v).unwrap();
    drop(store);
    // As if killed while writing: a partial temp file (and a stray dir) in tmp/.
    fs::write(
        dir.path().join("tmp").join(format!("{}.1.0.part", k.hex())),
        &v[..50],
    )
    .unwrap();
    fs::create_dir(dir.path().join("tmp/odd")).unwrap();
    let (store, _) = open(dir.path(), 1000);
    assert_eq!(store.open_report().removed_temp_files, 2);
    assert_eq!(temp_files(dir.path()), 0);
    assert_eq!(store.get(&k).unwrap().unwrap(), v);
}

#[test]
fn truncated_entry_is_dropped_at_open_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    let (k2, v2) = chunk(2, 100);
    store.put(&k, &v).unwrap();
    store.put(&k2, &v2).unwrap();
    let path = store.inner.entry_path(&k);
    drop(store);
    let f = File::options().write(true).open(&path).unwrap();
    f.set_len(60).unwrap();
    drop(f);
    let (store, _) = open(dir.path(), 1000);
    assert_eq!(store.open_report().dropped_entries, 1);
    assert!(store.get(&k).unwrap().is_none());
    assert!(!path.exists());
    let s = store.stats();
    assert_eq!(
        (s.entries, s.bytes, s.verification_failures, s.misses),
        (1, 100, 1, 1)
    );
    assert_eq!(store.get(&k2).unwrap().unwrap(), v2);
    // And it can be stored again.
    store.put(&k, &v).unwrap();
    assert_eq!(store.get(&k).unwrap().unwrap(), v);
}

#[test]
fn flipped_byte_is_a_counted_miss_on_first_read_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    let (k2, v2) = chunk(2, 100);
    store.put(&k, &v).unwrap();
    store.put(&k2, &v2).unwrap();
    drop(store);
    flip_first_byte(&dir.path().join("chunks").join(&k.hex()[..2]).join(k.hex()));
    flip_first_byte(
        &dir.path()
            .join("chunks")
            .join(&k2.hex()[..2])
            .join(k2.hex()),
    );
    let (store, _) = open(dir.path(), 1000);
    assert_eq!(store.open_report().dropped_entries, 0);
    assert!(store.get(&k).unwrap().is_none());
    assert!(store.open_chunk(&k2).unwrap().is_none());
    let s = store.stats();
    assert_eq!(
        (
            s.entries,
            s.bytes,
            s.hits,
            s.misses,
            s.verification_failures
        ),
        (0, 0, 0, 2, 2)
    );
    assert!(chunk_files(dir.path()).is_empty());
    drop(store);
    let (store, _) = open(dir.path(), 1000);
    assert_eq!(store.open_report().entries, 0);
}

#[test]
fn verified_entries_are_not_rehashed_but_verify_all_is() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    let (k2, v2) = chunk(2, 100);
    store.put(&k, &v).unwrap();
    store.put(&k2, &v2).unwrap();
    flip_first_byte(&store.inner.entry_path(&k));
    // Written by this process: trusted (the documented contract), so served as is.
    assert_eq!(store.get(&k).unwrap().map(|b| b.len()), Some(100));
    let r = store.verify_all().unwrap();
    assert_eq!(r.dropped, vec![k]);
    assert_eq!((r.good_entries, r.checked_bytes), (1, 100));
    assert!(store.get(&k).unwrap().is_none());
    assert_eq!(store.stats().verification_failures, 1);
    // A vanished file is dropped too.
    fs::remove_file(store.inner.entry_path(&k2)).unwrap();
    assert!(store.get(&k2).unwrap().is_none());
    assert_eq!(store.stats().verification_failures, 2);
    assert_eq!(store.stats().entries, 0);
}

#[test]
fn files_without_records_are_adopted_unverified_and_strays_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    store.put(&k, &v).unwrap();
    drop(store);
    // As if killed between rename and metadata commit.
    let (good, gv) = chunk(2, 100);
    let (bad, _) = chunk(3, 100);
    let place = |key: &ChunkKey, bytes: &[u8]| {
        fs::write(
            dir.path()
                .join("chunks")
                .join(&key.hex()[..2])
                .join(key.hex()),
            bytes,
        )
        .unwrap()
    };
    place(&good, &gv);
    place(&bad, &gv);
    fs::write(dir.path().join("chunks/00/not-a-key"), b"x").unwrap();
    fs::write(dir.path().join("chunks/stray"), b"x").unwrap();
    let (store, _) = open(dir.path(), 1000);
    let rep = store.open_report();
    assert_eq!(
        (rep.adopted_files, rep.removed_stray_files, rep.entries),
        (2, 2, 3)
    );
    // Adopted entries are the first to be evicted.
    let order = keys_lru_first(&store);
    assert_eq!(order[2], k);
    assert_eq!(store.get(&good).unwrap().unwrap(), gv);
    assert!(store.get(&bad).unwrap().is_none());
    assert_eq!(store.stats().verification_failures, 1);
}

#[test]
fn damaged_metadata_is_rebuilt_from_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    store.put(&k, &v).unwrap();
    store.pin("m", &[k]).unwrap();
    drop(store);
    fs::write(dir.path().join("meta.redb"), vec![0xA5u8; 9000]).unwrap();
    let (store, _) = open(dir.path(), 1000);
    let rep = store.open_report();
    assert!(rep.metadata_rebuilt);
    assert_eq!(rep.adopted_files, 1);
    assert_eq!(store.get(&k).unwrap().unwrap(), v);
    // Pins are lost with the metadata; the data is not.
    assert!(store.owners().is_empty());
    let moved = fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("meta.redb.corrupt-")
        })
        .count();
    assert_eq!(moved, 1);
}

#[test]
fn bad_records_in_metadata_are_dropped_without_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    store.put(&k, &v).unwrap();
    // Flushed first, so closing does not rewrite the record damaged below.
    store.flush().unwrap();
    {
        let txn = store.inner.db.begin_write().unwrap();
        {
            let mut t = txn.open_table(ENTRIES).unwrap();
            t.insert(&b"short key"[..], &b"junk"[..]).unwrap();
            t.insert(k.raw().as_slice(), &b"junk"[..]).unwrap();
            let mut p = txn.open_multimap_table(PINS).unwrap();
            p.insert("m", &b"bad"[..]).unwrap();
        }
        txn.commit().unwrap();
    }
    drop(store);
    let (store, _) = open(dir.path(), 1000);
    let rep = store.open_report();
    // Both bad records dropped; the file is then adopted from disk.
    assert_eq!((rep.dropped_entries, rep.adopted_files), (2, 1));
    assert_eq!(store.get(&k).unwrap().unwrap(), v);
    assert!(store.owners().is_empty());
    drop(store);
    let (store, _) = open(dir.path(), 1000);
    assert_eq!(store.open_report().dropped_entries, 0);
}

#[test]
fn pins_survive_a_restart_for_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 300);
    let chunks: Vec<_> = (0..3).map(|i| chunk(i, 100)).collect();
    for (k, v) in &chunks {
        store.put(k, v).unwrap();
    }
    store.pin("comes-back", &[chunks[0].0]).unwrap();
    store.pin("gone", &[chunks[1].0]).unwrap();
    drop(store);

    let (store, clock) = open(dir.path(), 300);
    assert_eq!(store.open_report().restored_pins, 2);
    let owners = store.owners();
    assert_eq!(owners.len(), 2);
    assert!(owners.iter().all(|o| o.restored));
    assert_eq!(store.pinned_keys("comes-back"), vec![chunks[0].0]);
    // During the grace period restored pins protect their entries.
    assert_eq!(store.gc_to(0).unwrap().evicted_entries, 1);
    assert!(store.contains(&chunks[0].0) && store.contains(&chunks[1].0));
    store.pin("comes-back", &[]).unwrap();
    clock.advance(Duration::from_secs(61));
    assert_eq!(
        store.expire_restored_pins().unwrap(),
        vec!["gone".to_string()]
    );
    assert_eq!(store.owners().len(), 1);
    assert_eq!(store.gc_to(0).unwrap().evicted_entries, 1);
    assert!(store.contains(&chunks[0].0) && !store.contains(&chunks[1].0));
    drop(store);

    // The expiry was persisted; the re-registered owner's pins were kept.
    let (store, _) = open(dir.path(), 300);
    assert_eq!(store.owners().len(), 1);
    assert_eq!(store.pinned_keys("comes-back"), vec![chunks[0].0]);
    store.inner.check_invariants();
}

#[test]
fn concurrent_puts_of_one_key_store_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 10 << 20);
    let (k, v) = chunk(9, 1 << 20);
    let threads = 16;
    let barrier = Barrier::new(threads);
    let outcomes: Vec<PutOutcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    store.put(&k, &v).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == PutOutcome::Stored)
            .count(),
        1
    );
    assert_eq!(store.stats().inserts, 1);
    assert_eq!(store.stats().bytes, 1 << 20);
    assert_eq!(chunk_files(dir.path()).len(), 1);
    assert_eq!(temp_files(dir.path()), 0);
}

#[test]
fn concurrent_readers_and_writers_never_see_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let max = 20_000;
    let (store, _) = open(dir.path(), max);
    let chunks: Vec<_> = (0..40u8)
        .map(|i| chunk(i, 1000 + i as usize * 37))
        .collect();
    std::thread::scope(|s| {
        for t in 0..6usize {
            let store = store.clone();
            let chunks = &chunks;
            s.spawn(move || {
                for i in 0..300usize {
                    let (k, v) = &chunks[(i * 7 + t * 13) % chunks.len()];
                    if (i + t) % 3 == 0 {
                        // Full is a legitimate answer when pins and other threads'
                        // reservations hold the room.
                        match store.put(k, v) {
                            Ok(_) | Err(Error::Full { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                        let st = store.stats();
                        assert!(st.bytes + st.reserved_bytes <= max);
                    } else if let Some(got) = store.get(k).unwrap() {
                        assert_eq!(&got, v);
                    }
                    if i % 50 == 0 {
                        store.pin(&format!("t{t}"), &[*k]).unwrap();
                    }
                    if i % 75 == 0 {
                        store.unpin_owner(&format!("t{t}")).unwrap();
                    }
                }
            });
        }
    });
    store.inner.check_invariants();
    assert!(store.stats().bytes <= max);
    assert_eq!(temp_files(dir.path()), 0);
    let on_disk: HashSet<PathBuf> = chunk_files(dir.path()).into_iter().collect();
    let listed: HashSet<PathBuf> = store
        .list()
        .iter()
        .map(|e| store.inner.entry_path(&e.key))
        .collect();
    assert_eq!(on_disk, listed);
}

#[test]
fn background_flusher_stops_on_close() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let store = Store::open_with(
        dir.path(),
        StoreOptions {
            flush_interval: Some(Duration::from_millis(1)),
            ..options(1000, &clock)
        },
    )
    .unwrap();
    let (k, v) = chunk(1, 10);
    store.put(&k, &v).unwrap();
    store.close().unwrap();
    // Closed and dropped: the store can be opened again at once.
    let store = Store::open_with(dir.path(), options(1000, &clock)).unwrap();
    assert!(store.contains(&k));
}

/// Operations of the model test.
#[derive(Debug, Clone)]
enum Op {
    Put(usize),
    Get(usize),
    Pin(usize, usize),
    Unpin(usize),
    Gc(u64),
    Reopen,
    /// Damage an entry's file, then reopen (damage within a process is trusted by design).
    CorruptAndReopen(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..12usize).prop_map(Op::Put),
        4 => (0..12usize).prop_map(Op::Get),
        1 => (0..3usize, 0..12usize).prop_map(|(o, k)| Op::Pin(o, k)),
        1 => (0..3usize).prop_map(Op::Unpin),
        1 => (0..1200u64).prop_map(Op::Gc),
        1 => Just(Op::Reopen),
        1 => (0..12usize).prop_map(Op::CorruptAndReopen),
    ]
}

/// The reference: recency order, pins, and which entries were damaged.
#[derive(Default)]
struct Model {
    lru: Vec<usize>,
    pins: HashMap<usize, HashSet<usize>>,
    corrupt: HashSet<usize>,
}

impl Model {
    fn pinned(&self, i: usize) -> bool {
        self.pins.values().any(|s| s.contains(&i))
    }
    fn used(&self, sizes: &[u64]) -> u64 {
        self.lru.iter().map(|i| sizes[*i]).sum()
    }
    fn touch(&mut self, i: usize) -> bool {
        match self.lru.iter().position(|x| *x == i) {
            Some(p) => {
                self.lru.remove(p);
                self.lru.push(i);
                true
            }
            None => false,
        }
    }
    fn evict_to(&mut self, target: u64, sizes: &[u64]) {
        while self.used(sizes) > target {
            let Some(p) = self.lru.iter().position(|i| !self.pinned(*i)) else {
                break;
            };
            let i = self.lru.remove(p);
            self.corrupt.remove(&i);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_match_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        let dir = tempfile::tempdir().unwrap();
        let max = 1000u64;
        let chunks: Vec<_> = (0..12u8).map(|i| chunk(i, 50 + (i as usize * 71) % 400)).collect();
        let sizes: Vec<u64> = chunks.iter().map(|(_, v)| v.len() as u64).collect();
        let (mut store, _) = open(dir.path(), max);
        let mut model = Model::default();
        for op in ops {
            match op {
                Op::Put(i) => {
                    let (k, v) = &chunks[i];
                    let r = store.put(k, v);
                    if model.touch(i) {
                        prop_assert_eq!(r.unwrap(), PutOutcome::AlreadyPresent);
                    } else {
                        let evictable: u64 = model.lru.iter().filter(|x| !model.pinned(**x)).map(|x| sizes[*x]).sum();
                        let need = (model.used(&sizes) + sizes[i]).saturating_sub(max);
                        if need > evictable {
                            let full = matches!(r, Err(Error::Full { .. }));
                            prop_assert!(full, "expected full, got {:?}", r);
                        } else {
                            prop_assert_eq!(r.unwrap(), PutOutcome::Stored);
                            model.evict_to(max - sizes[i], &sizes);
                            model.lru.push(i);
                        }
                    }
                }
                Op::Get(i) => {
                    let got = store.get(&chunks[i].0).unwrap();
                    if model.corrupt.remove(&i) {
                        prop_assert!(got.is_none());
                        model.lru.retain(|x| *x != i);
                    } else if model.touch(i) {
                        prop_assert_eq!(got.as_ref(), Some(&chunks[i].1));
                    } else {
                        prop_assert!(got.is_none());
                    }
                }
                Op::Pin(o, i) => {
                    store.pin(&format!("owner-{o}"), &[chunks[i].0]).unwrap();
                    model.pins.entry(o).or_default().insert(i);
                }
                Op::Unpin(o) => {
                    let n = store.unpin_owner(&format!("owner-{o}")).unwrap();
                    prop_assert_eq!(n, model.pins.remove(&o).map_or(0, |s| s.len()));
                }
                Op::Gc(target) => {
                    store.gc_to(target).unwrap();
                    model.evict_to(target, &sizes);
                }
                Op::Reopen => {
                    drop(store);
                    store = open(dir.path(), max).0;
                    prop_assert_eq!(store.open_report().restored_pins, model.pins.values().map(|s| s.len() as u64).sum::<u64>());
                }
                Op::CorruptAndReopen(i) => {
                    let path = store.inner.entry_path(&chunks[i].0);
                    drop(store);
                    if model.lru.contains(&i) && !model.corrupt.contains(&i) {
                        flip_first_byte(&path);
                        model.corrupt.insert(i);
                    }
                    store = open(dir.path(), max).0;
                }
            }
            store.inner.check_invariants();
            let expected: Vec<ChunkKey> = model.lru.iter().map(|i| chunks[*i].0).collect();
            prop_assert_eq!(keys_lru_first(&store), expected);
            prop_assert!(store.stats().bytes <= max);
        }
    }
}

#[test]
fn read_hits_reach_the_metadata_only_when_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let (store, clock) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    store.put(&k, &v).unwrap();
    store.flush().unwrap();
    let persisted = |store: &Store| {
        let txn = store.inner.db.begin_read().unwrap();
        let t = txn.open_table(ENTRIES).unwrap();
        let raw = t.get(k.raw().as_slice()).unwrap().unwrap();
        Record::decode(raw.value()).unwrap()
    };
    let before = persisted(&store);
    assert_eq!(before.last_access_ms, T0);
    clock.advance(Duration::from_secs(9));
    for _ in 0..10 {
        store.get(&k).unwrap().unwrap();
        store.open_chunk(&k).unwrap().unwrap();
    }
    assert_eq!(persisted(&store), before);
    store.flush().unwrap();
    let after = persisted(&store);
    assert_eq!(after.last_access_ms, T0 + 9000);
    assert!(after.tick > before.tick);
    assert_eq!(store.stats().hits, 20);
}

#[test]
fn a_put_is_served_at_once_and_recorded_by_the_next_flush() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1000);
    let (k, v) = chunk(1, 100);
    store.put(&k, &v).unwrap();
    assert_eq!(store.get(&k).unwrap().unwrap(), v);
    let recorded = |store: &Store| {
        let txn = store.inner.db.begin_read().unwrap();
        let t = txn.open_table(ENTRIES).unwrap();
        t.get(k.raw().as_slice()).unwrap().is_some()
    };
    // No metadata commit on the put path: a crash now leaves a file the next open
    // adopts (see `files_without_records_are_adopted_unverified_and_strays_removed`).
    assert!(!recorded(&store));
    store.flush().unwrap();
    assert!(recorded(&store));
    // An entry evicted after its record was written loses the record too.
    let (k2, v2) = chunk(2, 950);
    store.put(&k2, &v2).unwrap();
    assert!(store.get(&k).unwrap().is_none());
    store.flush().unwrap();
    assert!(!recorded(&store));
}

/// Chunks are bytes of image files that may be 0600 in their image: the store is its
/// owner's alone, and a store made with wider modes is tightened when opened.
#[test]
fn the_store_is_private_and_old_stores_are_tightened() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("store");
    let (store, _) = open(&dir, 1 << 20);
    let (key, bytes) = chunk(1, 1000);
    store.put(&key, &bytes).unwrap();
    store.flush().unwrap();
    drop(store);
    let file = chunk_files(&dir).pop().unwrap();
    let fanout = file.parent().unwrap().to_path_buf();
    let dirs = [
        dir.clone(),
        dir.join("chunks"),
        dir.join("tmp"),
        fanout.clone(),
    ];
    for d in &dirs {
        assert_eq!(mode(d), 0o700, "{}", d.display());
    }
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(&dir.join("meta.redb")), 0o600);
    // As an earlier version (umask 022) left it.
    for d in &dirs {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    for f in [&file, &dir.join("meta.redb")] {
        fs::set_permissions(f, fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (store, _) = open(&dir, 1 << 20);
    for d in &dirs {
        assert_eq!(mode(d), 0o700, "{} tightened", d.display());
    }
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(&dir.join("meta.redb")), 0o600);
    assert_eq!(store.get(&key).unwrap().unwrap(), bytes);
}
