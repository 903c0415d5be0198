//! The tree each piece travels along: roots, parents, children, fallbacks.
//!
//! Members are ranked for a piece by rendezvous score (best first). The first `roots`
//! ranks fetch the piece from the registry; every other rank `r` fetches it from rank
//! `(r - roots) / fanout`, so rank `q` serves ranks `roots + q × fanout ..` — at most
//! `fanout` children, a forest of `roots` trees of depth about
//! `log_fanout(members / roots)`. Because a rank only ever fetches from a lower rank,
//! no assignment (fallbacks included) can form a cycle.

use crate::error::{Result, invalid};
use crate::membership::Membership;
use crate::piece::PieceId;

/// How pieces are ranked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topology {
    /// One ranking per piece: each piece has its own roots and tree, so the registry
    /// fetches and the uploads of a blob spread over the fleet.
    PieceHrw,
    /// One ranking per blob (DADI's shape): the same few roots and the same tree carry
    /// every piece of the blob.
    BlobTree,
}

impl Topology {
    /// The name the command line and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Topology::PieceHrw => "piece-hrw",
            Topology::BlobTree => "blob-tree",
        }
    }

    /// Parses [`Topology::name`].
    pub fn parse(s: &str) -> Result<Topology> {
        match s {
            "piece-hrw" => Ok(Topology::PieceHrw),
            "blob-tree" => Ok(Topology::BlobTree),
            other => Err(invalid(
                "topology",
                format!("{other:?} (expected piece-hrw or blob-tree)"),
            )),
        }
    }
}

/// The scheduling parameters every node must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// How pieces are ranked.
    pub topology: Topology,
    /// Members that fetch each piece from the registry (R): the registry serves a piece
    /// at most this many times while no root fails.
    pub roots: usize,
    /// Children a member serves per piece at most (F).
    pub fanout: usize,
}

impl Schedule {
    /// Checked parameters: at least one root, fan-out between 1 and 64 (a member holds
    /// one connection per child per piece; more than 64 is not a bound worth having).
    pub fn new(topology: Topology, roots: usize, fanout: usize) -> Result<Schedule> {
        if roots == 0 {
            return Err(invalid("roots", "must be at least 1"));
        }
        if !(1..=64).contains(&fanout) {
            return Err(invalid("fanout", format!("{fanout} (must be 1 to 64)")));
        }
        Ok(Schedule {
            topology,
            roots,
            fanout,
        })
    }

    /// The key members are ranked by for `piece`.
    pub fn ranking_key(&self, piece: &PieceId) -> u64 {
        match self.topology {
            Topology::PieceHrw => piece.key(),
            Topology::BlobTree => piece.blob_key(),
        }
    }

    /// The tree of `piece` over `members`.
    pub fn tree(&self, members: &Membership, piece: &PieceId) -> PieceTree {
        PieceTree::from_key(members, *self, self.ranking_key(piece))
    }
}

/// Where a member fetches a piece from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// The registry (with its single flight: one request per root).
    Origin,
    /// The member with this index.
    Peer(usize),
}

/// One piece's ranking of the members and the forest built on it.
#[derive(Debug, Clone)]
pub struct PieceTree {
    schedule: Schedule,
    /// rank → member index.
    order: Vec<u32>,
    /// member index → rank.
    rank_of: Vec<u32>,
}

impl PieceTree {
    /// The tree for ranking key `key` (see [`Schedule::ranking_key`]).
    pub fn from_key(members: &Membership, schedule: Schedule, key: u64) -> PieceTree {
        let order: Vec<u32> = members.ranking(key).into_iter().map(|i| i as u32).collect();
        let mut rank_of = vec![0u32; order.len()];
        for (rank, &m) in order.iter().enumerate() {
            rank_of[m as usize] = rank as u32;
        }
        PieceTree {
            schedule,
            order,
            rank_of,
        }
    }

    /// How many members the tree spans.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether it spans none.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The member's rank (0 = first root).
    pub fn rank(&self, member: usize) -> usize {
        self.rank_of[member] as usize
    }

    /// The member at `rank`.
    pub fn member_at(&self, rank: usize) -> usize {
        self.order[rank] as usize
    }

    /// The members that fetch the piece from the registry, best first.
    pub fn roots(&self) -> impl Iterator<Item = usize> + '_ {
        self.order
            .iter()
            .take(self.schedule.roots)
            .map(|&m| m as usize)
    }

    /// Where `member` fetches the piece while everyone is up.
    pub fn parent(&self, member: usize) -> Source {
        let rank = self.rank(member);
        match rank.checked_sub(self.schedule.roots) {
            None => Source::Origin,
            Some(r) => Source::Peer(self.member_at(r / self.schedule.fanout)),
        }
    }

    /// The members `member` serves the piece to while everyone is up: at most the
    /// fan-out, the ranks right after the previous member's children.
    pub fn children(&self, member: usize) -> impl Iterator<Item = usize> + '_ {
        let first = self.schedule.roots + self.rank(member) * self.schedule.fanout;
        let end = (first + self.schedule.fanout).min(self.order.len());
        self.order
            .get(first.min(end)..end)
            .unwrap_or(&[])
            .iter()
            .map(|&m| m as usize)
    }

    /// Whom `member` asks, in order, when its parent fails (dies, stalls past the
    /// timeout, or serves bytes that fail verification): lower-ranked members, nearest
    /// first, skipping the parent and the siblings that lost the same parent — the
    /// nearest are the cousins one rank of parent up, usually leaves with free slots and
    /// the piece already arriving. At most `limit` candidates; after them, the
    /// registry. A candidate may refuse when its fan-out is full, so the bound holds
    /// through failures too. Roots have no candidates (they retry the registry).
    pub fn fallbacks(&self, member: usize, limit: usize) -> impl Iterator<Item = usize> + '_ {
        let rank = self.rank(member);
        let (below, parent_rank) = match rank.checked_sub(self.schedule.roots) {
            None => (0, usize::MAX),
            Some(r) => {
                let parent = r / self.schedule.fanout;
                (self.schedule.roots + parent * self.schedule.fanout, parent)
            }
        };
        (0..below)
            .rev()
            .filter(move |&r| r != parent_rank)
            .take(limit)
            .map(|r| self.member_at(r))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::membership::PeerId;

    fn fleet(n: usize) -> Membership {
        Membership::new((0..n).map(|i| PeerId(format!("10.0.{}.{}", i / 250, i % 250))))
    }

    fn piece(i: u32) -> PieceId {
        PieceId::new(ferry_oci::sha256_digest(b"layer"), i)
    }

    #[test]
    fn every_member_has_one_parent_and_fanout_holds() {
        for (n, roots, fanout) in [(1, 2, 4), (2, 2, 4), (7, 1, 1), (100, 2, 4), (1000, 3, 8)] {
            let s = Schedule::new(Topology::PieceHrw, roots, fanout).unwrap();
            let members = fleet(n);
            for p in 0..5 {
                let t = s.tree(&members, &piece(p));
                let mut served = vec![0usize; n];
                let mut origin = 0;
                for m in 0..n {
                    match t.parent(m) {
                        Source::Origin => origin += 1,
                        Source::Peer(q) => {
                            assert!(t.rank(q) < t.rank(m));
                            assert!(t.children(q).any(|c| c == m));
                            served[q] += 1;
                        }
                    }
                }
                assert_eq!(origin, roots.min(n));
                for (m, &count) in served.iter().enumerate() {
                    assert!(count <= fanout);
                    assert_eq!(t.children(m).count(), count);
                }
                assert_eq!(t.roots().count(), roots.min(n));
            }
        }
    }

    #[test]
    fn roots_are_the_hrw_owners() {
        let members = fleet(200);
        let s = Schedule::new(Topology::PieceHrw, 2, 4).unwrap();
        for p in 0..50 {
            let t = s.tree(&members, &piece(p));
            let roots: Vec<usize> = t.roots().collect();
            assert_eq!(roots, members.owners(piece(p).key(), 2));
        }
    }

    #[test]
    fn blob_tree_is_one_tree_for_all_pieces() {
        let members = fleet(100);
        let s = Schedule::new(Topology::BlobTree, 2, 4).unwrap();
        let first: Vec<Source> = (0..100)
            .map(|m| s.tree(&members, &piece(0)).parent(m))
            .collect();
        for p in 1..10 {
            let t = s.tree(&members, &piece(p));
            assert!((0..100).all(|m| t.parent(m) == first[m]));
        }
        let h = Schedule::new(Topology::PieceHrw, 2, 4).unwrap();
        let a: Vec<usize> = h.tree(&members, &piece(0)).roots().collect();
        let b: Vec<usize> = h.tree(&members, &piece(1)).roots().collect();
        assert_ne!(
            a, b,
            "per-piece ranking should pick other roots for another piece"
        );
    }

    #[test]
    fn fallbacks_rank_lower_and_skip_parent_and_siblings() {
        let members = fleet(300);
        let s = Schedule::new(Topology::PieceHrw, 2, 4).unwrap();
        let t = s.tree(&members, &piece(3));
        for m in 0..300 {
            let parent = t.parent(m);
            let candidates: Vec<usize> = t.fallbacks(m, 8).collect();
            assert!(candidates.len() <= 8);
            for c in &candidates {
                assert!(t.rank(*c) < t.rank(m));
                assert_ne!(Source::Peer(*c), parent);
                assert_ne!(t.parent(*c), parent, "a sibling shares the failed parent");
            }
            if parent == Source::Origin {
                assert!(candidates.is_empty());
            }
        }
    }

    #[test]
    fn parameters_are_checked() {
        assert!(Schedule::new(Topology::PieceHrw, 0, 4).is_err());
        assert!(Schedule::new(Topology::PieceHrw, 1, 0).is_err());
        assert!(Schedule::new(Topology::PieceHrw, 1, 65).is_err());
        assert_eq!(Topology::parse("blob-tree").unwrap(), Topology::BlobTree);
        assert!(Topology::parse("mesh").is_err());
    }
}
