//! Checks shared by the targets of TOC-described layers (eStargz, zstd:chunked).

use ferry_index::EntryKind;
use ferry_index::estargz::EstargzLayer;
use ferry_index::source::MemSource;

/// Exercises `ranges_for` and `read_at` on the first entries of `layer`: paths are
/// normalized, ranges lie before the TOC, and reads are clamped exactly at the end of
/// the file (never a panic, whatever the layer says).
pub fn exercise_reads(layer: &EstargzLayer, source: &MemSource) {
    for (idx, e) in layer.entries().iter().enumerate().take(16) {
        assert!(e.path.split('/').all(|c| c != ".." && c != "."));
        for (off, len) in [
            (0u64, 64usize),
            (1, 3),
            (e.size.saturating_sub(2), 8),
            (e.size, 1),
            (u64::MAX - 1, 4),
        ] {
            for r in layer.ranges_for(idx, off, len as u64) {
                assert!(r.start < r.end && r.end <= layer.toc_offset());
            }
            let mut buf = vec![0u8; len];
            if let Ok(n) = layer.read_at(source, idx, off, &mut buf) {
                let want = if matches!(e.kind, EntryKind::File) && off < e.size {
                    (e.size - off).min(len as u64) as usize
                } else if matches!(e.kind, EntryKind::Hardlink) {
                    n
                } else {
                    0
                };
                assert_eq!(n, want, "{}", e.path);
            }
        }
    }
}
