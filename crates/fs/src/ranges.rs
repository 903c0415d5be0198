//! Byte-range sets as sorted, disjoint `Range<u64>` lists: what prefetch, the nearby
//! planner and the ELF reader merge and subtract.

use std::ops::Range;

/// The parts of `want` outside `have` (sorted and disjoint, as [`merge_ranges`] gives).
pub fn subtract_ranges(want: &[Range<u64>], have: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    for w in want {
        let mut at = w.start;
        let first = have.partition_point(|h| h.end <= w.start);
        for h in &have[first..] {
            if h.start >= w.end {
                break;
            }
            if h.start > at {
                out.push(at..h.start);
            }
            at = at.max(h.end);
        }
        if at < w.end {
            out.push(at..w.end);
        }
    }
    out
}

/// Sorted, disjoint ranges covering the same bytes as `ranges`.
pub fn merge_ranges(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_ranges_joins_overlapping_and_touching_ranges() {
        assert_eq!(
            merge_ranges(vec![5..9, 0..2, 2..3, 8..12, 20..21]),
            vec![0..3, 5..12, 20..21]
        );
        assert!(merge_ranges(Vec::new()).is_empty());
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one-range slices are the point
    fn subtract_ranges_keeps_what_is_not_had() {
        assert_eq!(
            subtract_ranges(&[0..10], &[2..3, 5..7]),
            vec![0..2, 3..5, 7..10]
        );
        assert_eq!(subtract_ranges(&[0..10, 20..30], &[0..25]), vec![25..30]);
        assert!(subtract_ranges(&[4..6], &[0..10]).is_empty());
        assert_eq!(subtract_ranges(&[4..6], &[]), vec![4..6]);
    }
}
