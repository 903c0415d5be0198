//! The inflated-span cache's access pattern during a cold start: one reader per layer,
//! a span inflated once and then copied (4 KiB each) by the reads of its neighbouring files, a window
//! kept at each checkpoint passed and looked up by the next read along the stream.
//! Numbers are for comparing changes to the cache on one machine, not absolute.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use ferry_index::inflated::InflatedSpans;

/// The daemon's default bound (ferry-fs `DEFAULT_INFLATED_SPANS_BYTES`).
const MAX_BYTES: usize = 16 << 20;
/// A span's inflated size with the default index span size.
const SPAN_BYTES: usize = 1 << 20;
/// Reads (neighbouring small files) served from one span after it is inflated.
const READS_PER_SPAN: usize = 24;

fn cold_start(c: &mut Criterion) {
    let span = vec![7u8; SPAN_BYTES];
    let window = vec![3u8; 32 << 10];
    c.bench_function("inflated/neighbour_reads", |b| {
        let cache = InflatedSpans::new(MAX_BYTES);
        let layer = cache.new_key();
        let mut next_span = 0usize;
        b.iter(|| {
            // One span inflated and kept, then its neighbours' reads hit it.
            let s = next_span;
            next_span += 1;
            if cache.get(&layer, s).is_none() {
                cache.insert(&layer, s, span.clone());
            }
            let mut out = [0u8; 4096];
            for r in 0..READS_PER_SPAN {
                if let Some(cell) = cache.get(&layer, s) {
                    black_box(cache.read(&layer, s, &cell, r * 4096, &mut out).is_ok());
                }
            }
            // The read that inflated through the next checkpoint kept its window.
            if !cache.has_window(&layer, s + 1) {
                cache.insert_window(&layer, s + 1, &window);
            }
            black_box(cache.get_window(&layer, s + 1));
        });
    });
    c.bench_function("inflated/hit", |b| {
        let cache = InflatedSpans::new(MAX_BYTES);
        let layer = cache.new_key();
        for s in 0..8 {
            cache.insert(&layer, s, span.clone());
        }
        let mut i = 0usize;
        b.iter(|| {
            i = (i + 1) % 8;
            black_box(cache.get(&layer, i))
        });
    });
}

criterion_group!(benches, cold_start);
criterion_main!(benches);
