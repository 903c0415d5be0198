//! The registry's hot cache under its real access pattern: a fleet pulling the same few
//! manifests (gets of a small working set, nearly all hits) with a trickle of inserts of
//! new ones evicting old. Numbers are for comparing changes on one machine only.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use ferry_registry::server::hot_cache::HotCache;

const ENTRIES: usize = 4096;
const WORKING_SET: usize = 256;

fn digests(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("sha256:{i:064x}")).collect()
}

fn fleet_pull(c: &mut Criterion) {
    let hot = digests(WORKING_SET);
    let churn = digests(1 << 16);
    c.bench_function("hot_cache/hit", |b| {
        let cache = HotCache::new(ENTRIES, 64 << 20, Duration::from_secs(60));
        for d in &hot {
            cache.insert("library/app", d, d.len() as u64, 2048);
        }
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % WORKING_SET;
            black_box(cache.get("library/app", &hot[i]))
        });
    });
    c.bench_function("hot_cache/mixed_63_gets_1_insert", |b| {
        let cache = HotCache::new(ENTRIES, 64 << 20, Duration::from_secs(60));
        let mut i = 0;
        let mut j = 0;
        b.iter(|| {
            for _ in 0..63 {
                i = (i + 1) % WORKING_SET;
                if cache.get("library/app", &hot[i]).is_none() {
                    cache.insert("library/app", &hot[i], hot[i].len() as u64, 2048);
                }
            }
            j = (j + 1) % churn.len();
            cache.insert("library/other", &churn[j], 1, 2048);
        });
    });
}

criterion_group!(benches, fleet_pull);
criterion_main!(benches);
