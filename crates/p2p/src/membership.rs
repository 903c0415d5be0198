//! Membership as an input, and rendezvous (highest random weight) ranking over it.

use std::fmt;

use sha2::{Digest as _, Sha256};

use crate::piece::first_u64;

/// A peer's stable name (its address or node name, as membership reports it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub String);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for PeerId {
    fn from(s: &str) -> PeerId {
        PeerId(s.to_owned())
    }
}

/// A member and the rendezvous key derived from its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The peer.
    pub id: PeerId,
    /// SHA-256 of the name, first 8 bytes: the same on every node.
    pub key: u64,
}

/// The peers a node knows of, sorted by name and without duplicates, so that two nodes
/// given the same set (in any order) index it the same way.
#[derive(Debug, Clone, Default)]
pub struct Membership {
    members: Vec<Member>,
}

impl Membership {
    /// The membership of `ids` (duplicates dropped).
    pub fn new(ids: impl IntoIterator<Item = PeerId>) -> Membership {
        let mut ids: Vec<PeerId> = ids.into_iter().collect();
        ids.sort();
        ids.dedup();
        let members = ids
            .into_iter()
            .map(|id| {
                let key = first_u64(&Sha256::digest(id.0.as_bytes()));
                Member { id, key }
            })
            .collect();
        Membership { members }
    }

    /// How many members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The members, by index.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The index of `id`, if it is a member.
    pub fn index_of(&self, id: &PeerId) -> Option<usize> {
        self.members.binary_search_by(|m| m.id.cmp(id)).ok()
    }

    /// The `r` members with the highest rendezvous score for `key`, best first: the
    /// owners of that piece (or blob). O(members × log r).
    pub fn owners(&self, key: u64, r: usize) -> Vec<usize> {
        let mut best: Vec<(u64, usize)> = Vec::with_capacity(r + 1);
        if r == 0 {
            return Vec::new();
        }
        for (i, m) in self.members.iter().enumerate() {
            let s = hrw_score(key, m.key);
            if best.len() == r && s <= best[r - 1].0 {
                continue;
            }
            let at = best.partition_point(|&(b, _)| b >= s);
            best.insert(at, (s, i));
            best.truncate(r);
        }
        best.into_iter().map(|(_, i)| i).collect()
    }

    /// Every member ranked for `key`, best first. O(members × log members).
    pub fn ranking(&self, key: u64) -> Vec<usize> {
        let mut scored: Vec<(u64, usize)> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| (hrw_score(key, m.key), i))
            .collect();
        // Scores tie only by a 64-bit collision; the member index (name order) decides.
        scored.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        scored.into_iter().map(|(_, i)| i).collect()
    }
}

/// The rendezvous score of a member for a key: both keys mixed through SplitMix64's
/// finalizer, so a member's scores across keys behave as independent uniform draws
/// (a plain XOR of the keys would rank members the same way for related keys).
pub fn hrw_score(key: u64, member_key: u64) -> u64 {
    mix64(key ^ mix64(member_key.wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn fleet(n: usize) -> Membership {
        Membership::new((0..n).map(|i| PeerId(format!("node-{i}"))))
    }

    fn key(i: u64) -> u64 {
        mix64(i.wrapping_mul(0x2545_f491_4f6c_dd1d))
    }

    #[test]
    fn order_of_input_does_not_matter() {
        let a = fleet(50);
        let b = Membership::new((0..50).rev().map(|i| PeerId(format!("node-{i}"))));
        for k in 0..100 {
            assert_eq!(a.owners(key(k), 3), b.owners(key(k), 3));
            assert_eq!(a.ranking(key(k)), b.ranking(key(k)));
        }
    }

    #[test]
    fn owners_are_the_head_of_the_ranking() {
        let m = fleet(37);
        for k in 0..200 {
            let ranking = m.ranking(key(k));
            assert_eq!(m.owners(key(k), 4), ranking[..4].to_vec());
            assert_eq!(m.owners(key(k), 100), ranking);
        }
        assert!(m.owners(1, 0).is_empty());
    }

    #[test]
    fn ownership_is_balanced() {
        // 100 members, 20,000 pieces, 2 owners each: 400 expected per member; a binomial
        // spread of that size stays well within ±25 %.
        let m = fleet(100);
        let mut owned = vec![0u32; 100];
        for k in 0..20_000 {
            for o in m.owners(key(k), 2) {
                owned[o] += 1;
            }
        }
        let (min, max) = (owned.iter().min().unwrap(), owned.iter().max().unwrap());
        assert!(*min >= 300 && *max <= 500, "min {min} max {max}");
    }

    #[test]
    fn one_member_leaving_moves_only_its_pieces() {
        let m = fleet(60);
        let gone = PeerId("node-17".into());
        let rest = Membership::new(
            m.members()
                .iter()
                .map(|x| x.id.clone())
                .filter(|id| *id != gone),
        );
        let names = |ms: &Membership, idx: Vec<usize>| -> Vec<PeerId> {
            idx.into_iter()
                .map(|i| ms.members()[i].id.clone())
                .collect()
        };
        let mut moved = 0;
        for k in 0..5_000 {
            let before = names(&m, m.owners(key(k), 3));
            let after = names(&rest, rest.owners(key(k), 3));
            if before.contains(&gone) {
                moved += 1;
                // The survivors keep their places; one newcomer fills the gap at the end.
                let kept: Vec<_> = before.iter().filter(|p| **p != gone).cloned().collect();
                assert_eq!(after[..2], kept[..]);
            } else {
                assert_eq!(before, after, "piece {k} moved without its owner leaving");
            }
        }
        assert!(moved > 0);
    }

    #[test]
    fn index_of_finds_members() {
        let m = fleet(10);
        assert_eq!(
            m.index_of(&"node-3".into())
                .map(|i| &m.members()[i].id.0[..]),
            Some("node-3")
        );
        assert_eq!(m.index_of(&"node-10".into()), None);
    }
}
